"""Restarts on a used data folder: parts that start while Redis answers LOADING come up, and many
`splitbus up` cycles (with load, and a worker killed in each) leave the keys and the AOF bounded."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import redis

from splitbus.bus.core.keys import Keys
from splitbus.redis_server import EmbeddedRedis, embedded_url
from tests.e2e.conftest import System, start_system, stop_system
from tests.test_redis_server import aof_bytes, write_plain_aof

SPLITBUS = [sys.executable, "-m", "splitbus.cli.main"]


def _saw_loading(url: str, timeout_s: float) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=2, retry=None)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            client.ping()
            return False  # loaded before we looked
        except redis.exceptions.BusyLoadingError:
            return True
        except (redis.ConnectionError, redis.TimeoutError):
            time.sleep(0.01)
    return False


@pytest.mark.timeout(120)
def test_two_schedulers_started_while_redis_is_loading_come_up(tmp_path: Path) -> None:
    """The field report: `up --schedulers 2` on a used folder, both replicas died of
    BusyLoadingError in ensure_group. Here they start while a real Redis loads a 2M-command AOF."""
    write_plain_aof(tmp_path, 2_000_000)  # ~4 s of LOADING
    server = EmbeddedRedis(tmp_path)
    server.start(wait=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITBUS_")}
    env |= {"SPLITBUS_REDIS_URL": server.url, "SPLITBUS_PREFIX": "loading", "PYTHONUNBUFFERED": "1"}
    schedulers = [
        subprocess.Popen(
            SPLITBUS + ["scheduler", "--name", f"s{i}"],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        assert _saw_loading(server.url, 10), "Redis never answered LOADING: the test would prove nothing"
        server.wait_ready(60)
        admin = server.admin_client(decode_responses=True)
        deadline = time.monotonic() + 30
        while {c["name"] for c in _consumers(admin)} != {"s0", "s1"}:
            assert time.monotonic() < deadline, "the schedulers never joined their group"
            assert all(s.poll() is None for s in schedulers), "a scheduler exited"
            time.sleep(0.2)
    finally:
        for s in schedulers:
            s.send_signal(signal.SIGTERM)
        outputs = [s.communicate(timeout=30)[0] for s in schedulers]
        server.stop()
    assert [s.returncode for s in schedulers] == [0, 0], outputs
    assert any("loading the dataset" in out for out in outputs), outputs  # they did meet LOADING


def _consumers(admin: redis.Redis) -> list[dict]:
    try:
        requests = Keys("loading").requests
        admin.xadd(requests, {"probe": "1"})  # a consumer shows once it has read
        return admin.xinfo_consumers(requests, "schedulers")
    except redis.ResponseError:
        return []


def _wait_reaped(system: System) -> None:
    deadline = time.monotonic() + 60
    while not re.search(r"is dead: moved \d+ task", "".join(system.output)):
        assert time.monotonic() < deadline, "the killed worker was never reaped"
        time.sleep(0.2)


def _keys(data_dir: Path) -> tuple[int, int]:
    """(keys without a TTL, all keys) in the folder's Redis; every other key expires within
    the hour (results, dispatch marks, dead workers' records and streams)."""
    admin = embedded_url(data_dir / "redis", admin=True)
    assert admin
    client = redis.Redis.from_url(admin)
    ttls = {name: client.ttl(name) for name in client.scan_iter(count=1000)}
    assert all(ttl <= 3600 for ttl in ttls.values()), ttls
    return sum(1 for ttl in ttls.values() if ttl == -1), len(ttls)


@pytest.mark.timeout(600)
def test_many_up_cycles_on_one_folder(tmp_path: Path) -> None:
    """4 cycles of `up --engine sim --schedulers 2`, each serving requests and losing a decode
    worker to SIGKILL: every start succeeds, the keys that never expire do not grow, and each
    dead or stopped worker leaves only keys that expire (worker ids carry a pid, so without
    that every restart added a task and a control stream for good)."""
    persistent, total, aof = [], [], []
    for cycle in range(4):
        system = start_system(tmp_path, "--schedulers", "2", "--decode", "2", "--redis-maxmemory", "256mb")
        try:
            client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=30)
            for i in range(5):
                assert client.completions.create(model="tiny", prompt=f"c{cycle} r{i}", max_tokens=4).choices[0].text
            os.kill(system.pid_of(r"--role decode"), signal.SIGKILL)
            assert client.completions.create(model="tiny", prompt="after", max_tokens=4).choices[0].text
            _wait_reaped(system)
        finally:
            assert stop_system(system) == []
        with EmbeddedRedis(tmp_path / "redis"):
            keys = _keys(tmp_path)
        persistent.append(keys[0])
        total.append(keys[1])
        aof.append(aof_bytes(tmp_path / "redis"))
    # sb:requests, sb:run (the server run the cell was settled on) and sb:registry (the registry log,
    # bounded by MAXLEN); before, +2 streams per worker per cycle
    assert set(persistent) == {3}, persistent
    assert max(aof) < 8 * 1024 * 1024, aof
    print(f"keys without TTL per cycle {persistent}, all keys {total}, AOF bytes {aof}")
