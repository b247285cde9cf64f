"""`splitbus redis` and `splitbus up` as a user runs them: real processes, real signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from splitbus.redis_server import embedded_url
from tests.test_redis_server import _wait_gone

SPLITBUS = [sys.executable, "-m", "splitbus.cli.main"]


_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _kill_leftovers() -> Iterator[None]:
    """A failed assertion must not leave a server running (it would hold ports for later tests)."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLITBUS_OFFLINE": "1"}  # `up` fetches no model
    env.pop("SPLITBUS_REDIS_URL", None)
    proc = subprocess.Popen(
        SPLITBUS + args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    _STARTED.append(proc)
    return proc


def _read_until(proc: subprocess.Popen[str], pattern: str) -> re.Match[str]:
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"{pattern!r} never printed; output:\n{''.join(seen)}")


def _redis_pid(data_dir: Path) -> int:
    admin = embedded_url(data_dir / "redis", admin=True)
    assert admin is not None
    return int(redis.Redis.from_url(admin).info("server")["process_id"])


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_splitbus_redis_answers_ping_and_stops_without_orphan(tmp_path: Path, stop_signal: signal.Signals) -> None:
    proc = _start(["redis", "--data-dir", str(tmp_path)], tmp_path)
    url = _read_until(proc, r"Redis ready at (redis://\S+)").group(1)
    hint = _read_until(proc, r"try: (.*) PING$").group(1)
    password = (tmp_path / "redis" / "splitbus.password").read_text().strip()
    assert url.startswith("redis://splitbus:***@127.0.0.1:") and password not in url + hint
    pong = subprocess.run(f"{hint} PING", shell=True, capture_output=True, text=True, timeout=10)  # as printed
    assert pong.stdout.strip() == "PONG"
    redis_pid = _redis_pid(tmp_path)
    proc.send_signal(stop_signal)
    assert proc.wait(15) == 0
    assert _wait_gone(redis_pid), "redis-server left running"
    assert (tmp_path / "redis" / "redis.log").exists()


def test_splitbus_up_with_unreachable_redis_fails_clearly(tmp_path: Path) -> None:
    proc = _start(["up", "--redis-url", "redis://127.0.0.1:1/0", "--port", "1"], tmp_path)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "Redis at redis://127.0.0.1:1/0 is not reachable" in out


def test_splitbus_up_refuses_a_busy_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _start(["up", "--port", str(port), "--data-dir", str(tmp_path)], tmp_path)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prefill", "1", "--decode", "0"], "prefill and decode workers come together"),
        (["--prefill", "0", "--decode", "0"], "need at least one worker"),
    ],
)
def test_splitbus_up_rejects_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    proc = _start(["up", *args], tmp_path)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and message in out


def test_second_redis_on_same_data_dir_is_refused(tmp_path: Path) -> None:
    first = _start(["redis", "--data-dir", str(tmp_path)], tmp_path)
    _read_until(first, r"Redis ready at")
    try:
        second = _start(["redis", "--data-dir", str(tmp_path)], tmp_path)
        out, _ = second.communicate(timeout=30)
        assert second.returncode == 1
        assert "in use" in out
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(15)


def test_bad_prefix_in_environment_is_a_clear_error() -> None:
    proc = subprocess.run(
        SPLITBUS + ["redis"], capture_output=True, text=True, env={**os.environ, "SPLITBUS_PREFIX": "a b"}, timeout=30
    )
    assert proc.returncode == 2
    assert "SPLITBUS_PREFIX" in proc.stderr


def test_status_with_unreachable_redis_fails_clearly(tmp_path: Path) -> None:
    proc = _start(["status", "--redis-url", "redis://127.0.0.1:1/0"], tmp_path)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "is not reachable" in out


def test_status_and_up_mask_the_password_in_a_url(tmp_path: Path) -> None:
    for args in (["status"], ["up", "--port", "1"]):
        proc = _start([*args, "--redis-url", "redis://splitbus:hunter2hunter2@127.0.0.1:1/0"], tmp_path)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 1 and "redis://splitbus:***@127.0.0.1:1/0 is not reachable" in out
        assert "hunter2" not in out


def test_status_finds_the_embedded_redis_of_the_data_folder(tmp_path: Path) -> None:
    server = _start(["redis", "--data-dir", str(tmp_path)], tmp_path)
    _read_until(server, r"Redis ready at")
    try:
        proc = subprocess.run(
            SPLITBUS + ["status", "--json"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
            env={k: v for k, v in os.environ.items() if k != "SPLITBUS_REDIS_URL"}
            | {"SPLITBUS_DATA_DIR": str(tmp_path)},
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert '"workers": []' in proc.stdout
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(15)
