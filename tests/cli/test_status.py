"""`splitbus status` against the real Redis: which workers it lists, a reader that stops, and a
registry forged by whoever holds the Redis credentials."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import redis as sync_redis
import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.keys import WORKER_GROUP
from splitbus.bus.limits import Limiter, Verdict
from splitbus.bus.records import ExpertLoad, WorkerLoad
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.bus.tenants import Tenant, TenantLimits, TenantStore
from splitbus.cli.status_cmd import collect, render

SPLITBUS = [sys.executable, "-m", "splitbus.cli.main"]


async def _worker_with_tasks(redis: aioredis.Redis, config: BusConfig, registry: Registry, worker_id: str) -> None:
    record = WorkerRecord(worker_id=worker_id, role="decode", model="tiny", engine="sim")
    await registry.register(record, lease_ms=10_000)
    await redis.xgroup_create(config.keys.tasks(worker_id), WORKER_GROUP, id="0", mkstream=True)


async def test_status_lists_this_runs_workers_and_their_task_streams(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    registry = Registry(redis, bus_config)
    for worker_id in ("live", "died", "stopped"):
        await _worker_with_tasks(redis, bus_config, registry, worker_id)
    await registry.mark_dead("died")  # a reaper took its work: its record stays, state = dead
    await registry.deregister("stopped")  # a clean stop (an earlier run): only its task stream is left, for an hour
    with sync_redis.Redis.from_url(bus_config.redis_url, decode_responses=True) as client:
        status = collect(client, bus_config.prefix, bus_config.cell)
    assert [(w["id"], w["alive"]) for w in status["workers"]] == [("live", True), ("died", False)]
    keys = bus_config.keys
    assert [s["stream"] for s in status["streams"]] == [keys.requests, keys.tasks("died"), keys.tasks("live")]
    text = render(status)
    assert "stopped" not in text and text.count("DEAD") == 1


async def test_status_shows_a_moe_workers_experts(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    registry = Registry(redis, bus_config)
    many = ExpertLoad(64, (32, 64), (1,) * 32, tuple(range(100, 132)), weight_bytes=(3 * 2**20, 2**19))
    await registry.register(WorkerRecord("moe", "decode", "tiny", "paddle", load=WorkerLoad(experts=many)), 10_000)
    await _worker_with_tasks(redis, bus_config, registry, "dense")
    with sync_redis.Redis.from_url(bus_config.redis_url, decode_responses=True) as client:
        status = collect(client, bus_config.prefix, bus_config.cell)
    rows = {w["id"]: w for w in status["workers"]}
    assert rows["dense"]["experts"] is None and rows["moe"]["experts"]["total_tokens"] == list(range(100, 132))
    lines = render(status).splitlines()
    shown = lines[lines.index(next(line for line in lines if line.startswith("moe "))) + 1]
    counts = " ".join(map(str, range(100, 116)))
    assert shown == f"  experts 32-63 of 64, 3.0 + 0.5 MiB of weights, tokens since start: {counts} ... (16 more)"
    assert sum(line.startswith("  experts") for line in lines) == 1  # none under the dense worker


async def test_status_shows_the_tenants_in_flight_and_their_limits(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """acme (concurrency 3) holds two places, taken by two API nodes' limiters (and a lease that
    ran out, not counted); beta has no
    concurrency limit, so no count; a forged record is shown as such, the others whole."""
    store, keys = TenantStore(redis, bus_config.keys), bus_config.keys
    acme = TenantLimits(rps=5, concurrency=3, priority=1)
    await store.add(Tenant("acme", limits=acme))
    await store.add(Tenant("beta", limits=TenantLimits(tpm=100_000)))
    await redis.hset(keys.tenants, "forged", "not json")
    for node, request_id in enumerate(("r1", "r2")):
        admission = await Limiter(redis, keys).admit("acme", f"{request_id}-{node}", acme, 10, lease_ms=60_000)
        assert admission.verdict is Verdict.ADMITTED
    await redis.zadd(keys.inflight("acme"), {"crashed": 1})  # a lease that ran out long ago: not counted
    with sync_redis.Redis.from_url(bus_config.redis_url, decode_responses=True) as client:
        status = collect(client, bus_config.prefix, bus_config.cell)
    rows = {t.get("name", "?"): t for t in status["tenants"]}
    assert rows["acme"]["in_flight"] == 2 and rows["acme"]["concurrency"] == 3 and rows["acme"]["rps"] == 5
    assert rows["beta"]["in_flight"] is None and rows["beta"]["tpm"] == 100_000
    assert "not JSON" in rows["?"]["invalid"]
    lines = render(status).splitlines()
    assert lines[lines.index(next(line for line in lines if line.startswith("TENANT"))) :] == [
        f"{'TENANT':<24} {'IN FLIGHT':>12} LIMITS",
        f"{'acme':<24} {'2/3':>12} rps 5, concurrency 3, priority 1, weight 1",
        f"{'beta':<24} {'-':>12} tpm 100000, priority 0, weight 1",
        f"{'?':<24} invalid record: tenant 'forged': the record is not JSON",
    ]


async def test_status_shows_no_tenants_table_without_tenants(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    with sync_redis.Redis.from_url(bus_config.redis_url, decode_responses=True) as client:
        status = collect(client, bus_config.prefix, bus_config.cell)
    assert status["tenants"] == [] and "TENANT" not in render(status)


def test_status_watch_into_a_pipe_closed_early_ends_quietly(bus_config: BusConfig) -> None:
    env = {**os.environ, "SPLITBUS_REDIS_URL": bus_config.redis_url, "SPLITBUS_PREFIX": bus_config.prefix}
    proc = subprocess.Popen(
        [*SPLITBUS, "status", "--watch", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith("WORKER")  # what `| head -1` reads, then it exits
    proc.stdout.close()
    assert proc.wait(30) == 0
    assert proc.stderr.read() == ""  # no "not reachable", no traceback


FORGED: dict[str, dict[str, str | bytes]] = {
    "w-text": {"running": "many"},
    "w-negative": {"queued_prefill_tokens": "-1000000000"},
    "w-huge": {"free_kv_blocks": str(10**30)},
    "w-wide": {"running": str(2**40)},
    "w-boss": {"role": "boss"},
    "w-long": {"model": "m" * 5000},
    "w-binary": {"model": b"\xff\xfe"},
}
"""Workers registered honestly, then one field of each hash overwritten as anyone holding the
Redis credentials can; what status must say about each."""
REASONS = {
    "w-text": "running must be an integer, got 'many'",
    "w-negative": "queued_prefill_tokens must be >= 0, got -1000000000",
    "w-huge": "free_kv_blocks must be an integer",
    "w-wide": f"running must be <= {2**31 - 1}",
    "w-boss": "role must be one of",
    "w-long": "model must be at most 256 characters, got 5000",
    "w-binary": "'model' is not UTF-8",
    "w-string": "not a hash",
    "x" * 5000: "empty record",
    "\ufffd\x1b[2J": "empty record",  # an id that is not UTF-8 (b"\xff\x1b[2J"), as it reads
}


async def _forge_registry(redis: aioredis.Redis, config: BusConfig) -> None:
    """An honest worker with a load, one whose ``dp_group`` holds an escape sequence (a valid
    name: shown, without the escape), the forged workers, a worker key that is a string, ids of
    5000 characters and not UTF-8 with no record, and a task stream, the dead letters and a P-D
    link that are not of their type."""
    registry, keys = Registry(redis, config), config.keys
    await _worker_with_tasks(redis, config, registry, "honest")
    load = WorkerLoad(running=3, waiting=1, queued_prefill_tokens=77, free_kv_blocks=10, total_kv_blocks=64)
    await registry.heartbeat("honest", load, lease_ms=10_000)
    await registry.register(WorkerRecord("w-escape", "prefill", "tiny", dp_group="\x1b[2J", dp_rank=0), 10_000)
    for worker_id, fields in FORGED.items():
        await _worker_with_tasks(redis, config, registry, worker_id)
        await redis.hset(keys.worker(worker_id), mapping=fields)  # type: ignore[arg-type]  # bytes go as they are
    await registry.register(WorkerRecord("w-string", "decode", "tiny"), 10_000)
    await redis.delete(keys.worker("w-string"))
    await redis.set(keys.worker("w-string"), "not a hash")
    await redis.zadd(keys.workers, {"x" * 5000: 1, b"\xff\x1b[2J": 1})
    await redis.set(keys.tasks("w-text"), "not a stream")
    await redis.hset(keys.dead, "not", "a stream")
    await redis.set(keys.rdma("honest", "w-escape"), "not a hash")


def _status(config: BusConfig, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPLITBUS_REDIS_URL": config.redis_url, "SPLITBUS_PREFIX": config.prefix}
    return subprocess.run([*SPLITBUS, "status", *args], capture_output=True, text=True, env=env, timeout=60)


async def test_status_shows_forged_worker_records_as_invalid_and_the_honest_ones_whole(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    await _forge_registry(redis, bus_config)
    table = _status(bus_config)
    assert (table.returncode, table.stderr) == (0, "")
    lines = table.stdout.splitlines()
    role, dp, _lease, *load = next(line for line in lines if line.startswith("honest ")).split()[1:]
    assert (role, dp, load) == ("decode", "-", ["3", "1", "77", "10/64"])
    assert next(line for line in lines if line.startswith("w-escape ")).split()[1:3] == ["prefill", "?[2J/0"]
    for worker_id, reason in REASONS.items():
        shown = worker_id.replace("\x1b", "?") if len(worker_id) < 512 else "x" * 512 + "... (5000 characters)"
        line = next(line for line in lines if line.startswith(shown + " "))
        assert f"invalid record: {reason}" in line, line
    assert "\x1b" not in table.stdout and max(map(len, lines)) < 1000
    assert "dead letters: 0" in lines and "  None -> None: not a hash" in lines

    status = json.loads(_status(bus_config, "--json").stdout)
    assert [(w["id"], w["running"], w["dp_group"]) for w in status["workers"]] == [
        ("honest", 3, ""),
        ("w-escape", 0, "\x1b[2J"),  # exact in JSON, where it is escaped
    ]
    invalid = {w["id"]: w["invalid"] for w in status["invalid_workers"]}
    assert sorted(invalid) == sorted(REASONS)
    assert all(reason in invalid[worker_id] for worker_id, reason in REASONS.items())
    streams = [s["stream"] for s in status["streams"]]
    assert bus_config.keys.tasks("w-text") not in streams and bus_config.keys.tasks("honest") in streams


async def test_status_watch_json_reads_forged_records_on_every_refresh(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    """``--watch --json`` (one object a line) keeps refreshing over the forged registry."""
    await _forge_registry(redis, bus_config)
    env = {**os.environ, "SPLITBUS_REDIS_URL": bus_config.redis_url, "SPLITBUS_PREFIX": bus_config.prefix}
    proc = subprocess.Popen(
        [*SPLITBUS, "status", "--json", "--watch", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    for _ in range(3):
        assert len(json.loads(proc.stdout.readline())["invalid_workers"]) == len(REASONS)
    proc.stdout.close()
    assert proc.wait(30) == 0
    assert proc.stderr.read() == ""
