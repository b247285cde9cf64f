"""The external dispatcher example in DP mode against real rank processes and no scheduler: a
prefill group of 2 sim ranks and a decode group of 2. The example reads each rank's payload,
picks the ranks itself, writes the tasks and reads the result streams (docs/protocol.md). On a
single Redis and on a cluster (``rediss+cluster://`` in ``SPLITBUS_REDIS_URL``, TLS with the
cluster's CA and client certificate, which the example opens with plain redis-py)."""

from __future__ import annotations

import ast
import json
import os
import runpy
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import redis

from splitbus.bus.core.connection import connect_sync
from splitbus.bus.core.keys import Keys
from splitbus.redis_server import EmbeddedRedis
from splitbus.worker.engines.sim import sim_text

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "external_dispatcher.py"
RANKS = {
    f"{group}-r{rank}": (role, group, rank) for role, group in (("prefill", "p0"), ("decode", "d0")) for rank in (0, 1)
}


@dataclass
class Ranks:
    redis_url: str
    prefix: str

    def client(self) -> redis.Redis:
        return connect_sync(self.redis_url, decode_responses=True)  # a RedisCluster for a cluster URL


def _rank(worker_id: str, model: Path, url: str, prefix: str) -> subprocess.Popen[str]:
    role, group, rank = RANKS[worker_id]
    env = {**os.environ, "SPLITBUS_PREFIX": prefix, "SPLITBUS_REDIS_URL": url, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "splitbus.cli.main", "worker", "--role", role, "--engine", "sim"]
    cmd += ["--model", str(model), "--worker-id", worker_id, "--kv-blocks", "512"]
    cmd += ["--dp-group", group, "--dp-rank", str(rank), "--dp-size", "2"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env)


@pytest.fixture
def ranks(redis_server: EmbeddedRedis, bus_environ: dict[str, str], tiny_model: Path) -> Iterator[Ranks]:
    """The four ranks on the session's single Redis, then on the session cluster."""
    url, prefix = bus_environ.get("SPLITBUS_REDIS_URL", redis_server.url), f"x{uuid.uuid4().hex[:8]}"
    procs = [_rank(w, tiny_model, url, prefix) for w in RANKS]
    running = Ranks(url, prefix)
    client, deadline = running.client(), time.monotonic() + 60
    try:
        while not all(client.exists(Keys(prefix).lease(w)) for w in RANKS):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "ranks did not register"
            time.sleep(0.1)
        yield running
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            assert proc.wait(30) == 0


def _dispatch(ranks: Ranks, *args: str) -> subprocess.CompletedProcess[str]:
    # The URL (with the fixture's password) goes through the environment, never argv.
    env = {**os.environ, "SPLITBUS_REDIS_URL": ranks.redis_url, "SPLITBUS_PREFIX": ranks.prefix}
    cmd = [sys.executable, str(EXAMPLE), "--dp", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env, check=False)


def _counters(ranks: Ranks, name: str) -> dict[str, int]:
    """``name`` per rank once the ranks' heartbeats add up to the 4 requests (bounded wait)."""
    client, deadline = ranks.client(), time.monotonic() + 10
    while True:
        found = {w: int(client.hget(Keys(ranks.prefix).worker(w), name) or 0) for w in RANKS}
        if sum(found.values()) >= 4 or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_the_dispatcher_spreads_requests_over_prefill_and_decode_ranks(ranks: Ranks) -> None:
    out = _dispatch(ranks, "--requests", "4", "--max-tokens", "7", "--seed", "20")
    assert out.returncode == 0, out.stdout + out.stderr
    assert ranks.redis_url not in out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for worker, (role, group, rank) in RANKS.items():
        assert any(line.startswith(f"{worker}: {role} rank {rank} of {group} (2)") for line in lines), out.stdout
    texts: dict[int, str] = {}  # by the request's index (ids are ext-RUN-INDEX; request i has seed 20 + i)
    for kind, request_id, data in (line.split(maxsplit=2) for line in lines if line.startswith(("token ", "final "))):
        entry, index = json.loads(data), int(request_id.rsplit("-", 1)[1])
        texts[index] = texts.get(index, "") + entry["text"]
        assert kind == "token" or entry["finish_reason"] == "length"
    assert texts == {i: sim_text(20 + i, 7) for i in range(4)}
    # Each rank of a group got half of the requests: the dispatcher spread them, and the ranks did them.
    prefills, decodes = _counters(ranks, "prefills_done"), _counters(ranks, "decodes_done")
    assert prefills == {"p0-r0": 2, "p0-r1": 2, "d0-r0": 0, "d0-r1": 0}
    assert decodes == {"p0-r0": 0, "p0-r1": 0, "d0-r0": 2, "d0-r1": 2}
    # The tasks as written: a prefill task carries its group's batch id and how many ranks the batch
    # went to (so the ranks prefill it in one step), the two tasks of a request one hand-off id.
    tasks = {
        w: [json.loads(fields["data"]) for _, fields in _entries(ranks, Keys(ranks.prefix).tasks(w))] for w in RANKS
    }
    prefill_tasks = tasks["p0-r0"] + tasks["p0-r1"]
    assert {(t["phase"], t["batch_ranks"]) for t in prefill_tasks} == {("prefill", 2)}
    assert len({t["batch_id"] for t in prefill_tasks}) == 1 and prefill_tasks[0]["batch_id"].endswith(".p0")
    handoffs = {t["request"]["request_id"]: t["handoff"] for t in prefill_tasks}
    decode_tasks = tasks["d0-r0"] + tasks["d0-r1"]
    assert {t["request"]["request_id"]: t["handoff"] for t in decode_tasks} == handoffs and len(handoffs) == 4
    assert all(t["phase"] == "decode" and "batch_id" not in t for t in decode_tasks)


def _entries(ranks: Ranks, key: str) -> list[tuple[str, dict[str, str]]]:
    return cast(list[tuple[str, dict[str, str]]], ranks.client().xrange(key))


def test_the_dispatcher_takes_complete_groups_only() -> None:
    def rank(role: str, group: str, rank: object, size: object, epoch: str = "5") -> dict[str, object]:
        return {"role": role, "dp_group": group, "dp_rank": rank, "dp_size": size, "dp_epoch": epoch}

    workers = {
        "a0": rank("prefill", "a", "0", "2"),
        "a1": rank("prefill", "a", "1", "2"),
        "b0": rank("prefill", "b", "0", "2"),  # rank 1 missing
        "c0": rank("prefill", "c", "0", "2"),
        "c1": rank("prefill", "c", "1", "3"),  # the ranks disagree on the size
        "e0": rank("prefill", "e", "0", "2"),
        "e0bis": rank("prefill", "e", "0", "2"),  # two workers claim one rank
        "f0": rank("prefill", "f", "x", "2"),  # not a number
        "g0": rank("prefill", "g", "0", "2"),
        "g1": rank("prefill", "g", "1", "2", epoch="0"),  # restarted, not stepping with g0 yet
        "h0": rank("prefill", "h", "0", "2"),
        "h1": rank("prefill", "h", "1", "2", epoch="6"),  # the ranks formed different epochs
        "solo": {"role": "prefill", "dp_group": "", "dp_rank": "-1", "dp_size": "0"},
        "d0": rank("decode", "d", "0", "1"),
    }
    groups = runpy.run_path(str(EXAMPLE), run_name="external_dispatcher")["complete_groups"]
    assert groups(workers, "prefill") == {"a": ["a0", "a1"], "solo": ["solo"]}
    assert groups(workers, "decode") == {"d": ["d0"]}


def test_the_dispatcher_needs_redis_py_only() -> None:
    """The example is the protocol's contract for a dispatcher in any language: it imports no splitbus."""
    tree = ast.parse(EXAMPLE.read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "redis" in modules and not any(name.split(".")[0] == "splitbus" for name in modules)
