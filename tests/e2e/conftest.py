"""`splitbus up` as a user runs it, on loopback, with the sim engine."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from splitbus.bus.core.connection import connect_sync
from splitbus.redis_server import embedded_url, free_port


@dataclass
class System:
    proc: subprocess.Popen[str]
    base_url: str
    redis_url: str
    output: list[str] = field(default_factory=list)

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def redis(self) -> redis.Redis:
        """A client for the system's Redis: a ``redis.RedisCluster`` for a ``redis+cluster://`` URL."""
        return connect_sync(self.redis_url, decode_responses=True)

    def descendants(self) -> list[int]:
        return _descendants(self.proc.pid)

    def wait_output(self, pattern: str, timeout_s: float = 30.0, start: int = 0) -> re.Match[str]:
        """The first match of ``pattern`` in what ``up`` printed (from line ``start`` on)."""
        deadline = time.monotonic() + timeout_s
        while True:
            match = re.search(pattern, "".join(self.output[start:]), re.M)
            if match:
                return match
            assert time.monotonic() < deadline, f"{pattern!r} never printed:\n" + "".join(self.output)
            time.sleep(0.05)

    def pids_of(self, pattern: str) -> list[int]:
        return [pid for pid in self.descendants() if re.search(pattern, _cmdline(pid))]

    def pid_of(self, pattern: str) -> int:
        for pid in self.descendants():
            if re.search(pattern, _cmdline(pid)):
                return pid
        raise LookupError(pattern)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_system(data_dir: Path, *args: str, environ: dict[str, str] | None = None) -> System:
    """``environ``: more variables for ``up`` (its secrets: ``SPLITBUS_API_KEYS``). SPLITBUS_OFFLINE:
    no test reaches a package index; without ``--model`` the paddle engine serves the tiny model."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLITBUS_OFFLINE": "1"}
    for name in ("SPLITBUS_REDIS_URL", "SPLITBUS_API_KEYS", "SPLITBUS_PREFIX"):
        env.pop(name, None)
    env.update(environ or {})
    engine = [] if "--engine" in args else ["--engine", "sim"]
    cmd = [
        sys.executable,
        "-m",
        "splitbus.cli.main",
        "up",
        *engine,
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        *args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    system = System(proc, f"http://127.0.0.1:{port}", "")
    try:
        _wait_until_up(system)
        # The banner masks the password: the test inspects Redis as its admin, from the data folder.
        given = args[args.index("--redis-url") + 1] if "--redis-url" in args else env.get("SPLITBUS_REDIS_URL")
        system.redis_url = given or embedded_url(data_dir / "redis", admin=True) or ""
    except BaseException:
        proc.kill()  # its children die with it (PR_SET_PDEATHSIG)
        raise
    return system


def _wait_until_up(system: System) -> None:
    proc = system.proc
    assert proc.stdout is not None
    deadline = time.monotonic() + 90
    for line in proc.stdout:
        system.output.append(line)
        match = re.search(r"splitbus is up: API (\S+)/v1  Redis (\S+)", line)
        if match:
            system.redis_url = match.group(2)
            break
        assert time.monotonic() < deadline, "".join(system.output)
    else:
        raise AssertionError("splitbus up ended before it was ready:\n" + "".join(system.output))
    import threading

    threading.Thread(target=lambda: system.output.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]


def stop_system(system: System) -> list[int]:
    """SIGINT, as Ctrl-C; returns the processes that outlived it (none, when all is well)."""
    before = system.descendants()
    system.proc.send_signal(signal.SIGINT)
    system.proc.wait(60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in before):
        time.sleep(0.1)
    return [p for p in before if alive(p)]


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("up"))
    yield running
    assert stop_system(running) == []
