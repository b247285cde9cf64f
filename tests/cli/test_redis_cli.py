"""`splitbus redis-cli`: the shipped redis-cli against the embedded Redis of a data folder, as an
operator runs it (a real server, a real redis-cli process)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitbus.cli.main import build_parser
from splitbus.cli.redis_cli_cmd import connection_options, parse
from splitbus.env import Env
from splitbus.redis_server import EmbeddedRedis
from tests.cli.test_secrets import _environ

SPLITBUS = [sys.executable, "-m", "splitbus.cli.main"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """An embedded Redis in ``<data folder>/redis``, where ``up`` puts it."""
    with EmbeddedRedis(tmp_path_factory.mktemp("data") / "redis", appendonly=False) as running:
        yield running


def _environment(**extra: str) -> dict[str, str]:
    unset = ("SPLITBUS_REDIS_URL", "SPLITBUS_DATA_DIR", "REDISCLI_AUTH")
    return {k: v for k, v in os.environ.items() if k not in unset} | extra


def _cli(server: EmbeddedRedis, *args: str) -> subprocess.CompletedProcess[str]:
    data_dir = str(server.data_dir.parent)
    return subprocess.run(
        [*SPLITBUS, "redis-cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=_environment(SPLITBUS_DATA_DIR=data_dir),
    )


def test_ping_answers_pong_from_the_data_folder(server: EmbeddedRedis) -> None:
    done = _cli(server, "PING")
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "PONG", "")


def test_data_dir_option_and_redis_cli_options_pass_through(server: EmbeddedRedis, tmp_path: Path) -> None:
    server.admin_client().xadd("t-cli:dead", {"f": "v"})
    argv = ["redis-cli", "--data-dir", str(server.data_dir.parent), "--no-raw", "XLEN", "t-cli:dead"]
    done = subprocess.run(
        [*SPLITBUS, *argv], capture_output=True, text=True, timeout=30, cwd=tmp_path, env=_environment()
    )
    assert (done.returncode, done.stdout.strip()) == (0, "(integer) 1"), done.stderr


def test_admin_command_needs_admin(server: EmbeddedRedis) -> None:
    refused = _cli(server, "CONFIG", "GET", "maxmemory-policy")
    assert "NOPERM" in refused.stdout + refused.stderr and "noeviction" not in refused.stdout
    allowed = _cli(server, "--admin", "CONFIG", "GET", "maxmemory-policy")
    assert (allowed.returncode, allowed.stdout.split()) == (0, ["maxmemory-policy", "noeviction"]), allowed.stderr


def test_the_password_goes_in_the_environment_not_argv(server: EmbeddedRedis) -> None:
    password = server.password_path.read_text().strip()
    blocking = ["XREAD", "BLOCK", "0", "STREAMS", "t-cli:never", "$"]  # keeps redis-cli running to be looked at
    proc = subprocess.Popen(
        [*SPLITBUS, "redis-cli", *blocking],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_environment(SPLITBUS_DATA_DIR=str(server.data_dir.parent)),
    )
    try:
        cmdline = _wait_for_exec(proc.pid)
        assert password not in cmdline
        assert cmdline[1:] == ["-h", server.host, "-p", str(server.port), "--user", "splitbus", *blocking]
        assert _environ(proc.pid)["REDISCLI_AUTH"] == password
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def _wait_for_exec(pid: int) -> list[str]:
    """The process's argv once it has become redis-cli (it starts as Python)."""
    for _ in range(300):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        if cmdline and Path(cmdline[0]).name == "redis-cli":
            return cmdline
        time.sleep(0.05)
    raise AssertionError(f"never became redis-cli: {cmdline}")


def test_exit_code_and_errors_are_redis_clis(server: EmbeddedRedis) -> None:
    refused = _cli(server, "--no-such-option")
    assert refused.returncode == 1 and "Unrecognized option" in refused.stderr  # redis-cli's words, not argparse's


def test_no_embedded_redis_for_admin_is_one_clear_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [*SPLITBUS, "redis-cli", "--admin", "--data-dir", str(tmp_path), "PING"],
        capture_output=True,
        text=True,
        timeout=30,
        env=_environment(),
    )
    assert done.returncode == 2 and done.stdout == ""
    message = f"no embedded Redis recorded in {tmp_path / 'redis'}: start `splitbus up`, or pass --data-dir"
    assert done.stderr == f"splitbus redis-cli: {message}\n"


def test_admin_with_an_explicit_url_is_refused() -> None:
    done = subprocess.run(
        [*SPLITBUS, "redis-cli", "--admin", "PING"],
        capture_output=True,
        text=True,
        timeout=30,
        env=_environment(SPLITBUS_REDIS_URL="redis://u:hunter2hunter2@127.0.0.1:1/0"),
    )
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "--admin" in done.stderr
    assert "hunter2" not in done.stderr


def _parse(*argv: str) -> argparse.Namespace:
    return parse(build_parser(Env()), list(argv))


@pytest.mark.parametrize(
    "argv, admin, url, rest",
    [
        (["XINFO", "GROUPS", "sb:requests"], False, None, ["XINFO", "GROUPS", "sb:requests"]),
        (["--admin", "--no-raw", "XLEN", "sb:dead"], True, None, ["--no-raw", "XLEN", "sb:dead"]),
        (["--redis-url=redis://h:1/0", "-n", "2", "--admin"], False, "redis://h:1/0", ["-n", "2", "--admin"]),
        (["--redis-url", "redis://h:1/0", "--", "--admin"], False, "redis://h:1/0", ["--admin"]),
        ([], False, None, []),
    ],
)
def test_splitbus_options_come_first_the_rest_is_kept(
    argv: list[str], admin: bool, url: str | None, rest: list[str]
) -> None:
    args = _parse(*argv)
    assert (args.admin, args.redis_url, args.cli_args) == (admin, url, rest)


@pytest.mark.parametrize(
    "url, options, password",
    [
        ("redis://splitbus:p%40ss@127.0.0.1:6400/0", ["-h", "127.0.0.1", "-p", "6400", "--user", "splitbus"], "p@ss"),
        ("rediss://:pw@db.example:7000/3", ["-h", "db.example", "-p", "7000", "--tls", "-n", "3"], "pw"),
        ("unix:///run/redis.sock", ["-s", "/run/redis.sock"], None),
        ("redis://localhost", ["-h", "localhost", "-p", "6379"], None),
    ],
)
def test_connection_options_from_a_url(url: str, options: list[str], password: str | None) -> None:
    assert connection_options(url) == (options, password)
