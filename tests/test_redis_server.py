"""The embedded redis-server: start, stop, data-folder lock, and no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from splitbus.redis_server import EmbeddedRedis, RedisServerError, find_redis_server, server_version


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purposes
        return f.read().split()[2] != "Z"


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_found_server_is_recent_enough() -> None:
    assert server_version(find_redis_server())[:2] >= (6, 2)


def test_start_writes_aof_and_stop_leaves_no_process(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path)
    url = server.start()
    pid = server.pid
    assert pid is not None
    client = redis.Redis.from_url(url)
    assert client.ping()
    assert client.config_get("appendonly")["appendonly"] == "yes"
    client.set("k", "v")
    client.close()
    server.stop()
    assert _wait_gone(pid)
    with EmbeddedRedis(tmp_path) as again:  # the AOF brings the data back
        assert redis.Redis.from_url(again.url).get("k") == b"v"


def test_data_folder_is_locked(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path):
        with pytest.raises(RedisServerError, match="in use"):
            EmbeddedRedis(tmp_path).start()


def test_port_in_use_gives_a_clear_error(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "a") as first:
        with pytest.raises(RedisServerError, match="exited at start"):
            EmbeddedRedis(tmp_path / "b", port=first.port).start()


def test_server_dies_with_a_killed_parent(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from splitbus.redis_server import EmbeddedRedis\n"
        f"s = EmbeddedRedis({str(tmp_path)!r}); s.start()\n"
        "print(s.pid, flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    redis_pid = int(parent.stdout.readline())
    assert _pid_alive(redis_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _wait_gone(redis_pid), "redis-server outlived its killed parent"
