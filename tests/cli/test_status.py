"""`splitbus status` against the real Redis: which workers it lists, and a reader that stops."""

from __future__ import annotations

import os
import subprocess
import sys

import redis as sync_redis
import redis.asyncio as aioredis

from splitbus.bus.config import BusConfig
from splitbus.bus.keys import WORKER_GROUP
from splitbus.bus.registry import Registry, WorkerRecord
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
