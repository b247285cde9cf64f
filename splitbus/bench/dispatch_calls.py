"""What one dispatch costs Redis, by how many are asked for in one event-loop turn.

Each dispatch is one ``dispatch`` script call, and the calls of one turn share a pipeline
(``splitbus/bus/dispatch.py``). This measures, for 1, 8 and 32 dispatches a turn (a scheduler's
batch at low, moderate and flood load), the script calls, their Redis time per dispatch
(``INFO commandstats``: the URL's user must be allowed ``INFO``, as the embedded Redis's admin
is) and the wall time per dispatch seen by the caller. Each dispatch is a request
entry read by a scheduler's consumer, placed on one prefill and one decode worker, as in
``bench scheduler``; its own key prefix, deleted after.

    python -m splitbus.bench.dispatch_calls REDIS_URL [--dispatches 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from splitbus import aio
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.core.keys import SCHEDULER_GROUP
from splitbus.bus.core.streams import Delivery, GroupConsumer, Producer
from splitbus.bus.dispatch import DispatchOutcome
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.records import Reserved
from splitbus.bus.registry import Registry, WorkerInfo, WorkerRecord
from splitbus.bus.roles import Phase, Role
from splitbus.bus.runs import CellRun
from splitbus.placement.decision import Placement
from splitbus.placement.dispatcher import Dispatcher

PER_TURN = (1, 8, 32)
PROMPT_TOKENS = 128
"""As ``bench scheduler``'s requests: the task's JSON is most of what a dispatch writes."""


async def measure(url: str, dispatches: int, per_turn: tuple[int, ...] = PER_TURN) -> list[dict[str, Any]]:
    """One row per entry of ``per_turn``: script calls, Redis µs and wall µs per dispatch."""
    config = BusConfig(redis_url=url, prefix=f"bench-dispatch-{uuid.uuid4().hex[:8]}")
    redis = connect(config)
    try:
        await CellRun(redis, config.keys).settle()
        plan = await _workers(redis, config)
        await _dispatch_all(redis, config, await _entries(redis, config, 1, 0), plan, 1)  # the script loaded
        rows = []
        for per in per_turn:
            deliveries = await _entries(redis, config, dispatches, per)
            rows.append(await _dispatch_all(redis, config, deliveries, plan, per))
        return rows
    finally:
        await _forget(redis, config)
        await redis.aclose()


async def _workers(redis: aioredis.Redis, config: BusConfig) -> list[Placement]:
    registry = Registry(redis, config)
    infos = []
    for wid, role in (("p", Role.PREFILL), ("d", Role.DECODE)):
        record = WorkerRecord(worker_id=wid, role=role, model="m")
        await registry.register(record, 600_000)
        infos.append(WorkerInfo(record, 0, 600_000))
    prefill, decode = infos
    return [
        Placement(decode, Phase.DECODE, "p", Reserved(0, 1, 12)),
        Placement(prefill, Phase.PREFILL, "d", Reserved(PROMPT_TOKENS, 0, 0)),
    ]


async def _entries(redis: aioredis.Redis, config: BusConfig, n: int, per: int) -> list[Delivery]:
    consumer = GroupConsumer(redis, config, config.keys.requests, SCHEDULER_GROUP, "bench")
    await consumer.ensure_group()
    producer = Producer(redis, config)
    for i in range(n):
        tokens = [(i + t) % 50_000 for t in range(PROMPT_TOKENS)]
        request = GenerateRequest(f"per{per}-{i}", "m", tokens, SamplingParams(max_tokens=64), "api", 0)
        await producer.send(config.keys.requests, request)
    deliveries: list[Delivery] = []
    while len(deliveries) < n:
        deliveries += await consumer.read(min(256, n - len(deliveries)))
    return deliveries


async def _dispatch_all(
    redis: aioredis.Redis, config: BusConfig, deliveries: list[Delivery], plan: list[Placement], per: int
) -> dict[str, Any]:
    dispatcher = Dispatcher(redis, config, 60)
    calls_before, usec_before = await _script_stats(redis)
    started = time.perf_counter()
    for i in range(0, len(deliveries), per):
        turn = deliveries[i : i + per]
        outcomes = await asyncio.gather(*(dispatcher.dispatch(d.entry_id, d.message, plan, "bench") for d in turn))
        if any(o is not DispatchOutcome.DISPATCHED for o in outcomes):
            raise RuntimeError(f"a dispatch was not written: outcomes {set(outcomes)}")
    wall_s = time.perf_counter() - started
    calls, usec = await _script_stats(redis)
    n = len(deliveries)
    return {
        "per_turn": per,
        "dispatches": n,
        "script_calls": calls - calls_before,
        "redis_us_per_dispatch": (usec - usec_before) / n,
        "wall_us_per_dispatch": wall_s * 1e6 / n,
    }


async def _script_stats(redis: aioredis.Redis) -> tuple[int, float]:
    """``EVALSHA`` calls and Redis's time in them so far, every client's (nothing else runs
    scripts meanwhile)."""
    stats = (await redis.info("commandstats")).get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


async def _forget(redis: aioredis.Redis, config: BusConfig) -> None:
    async for key in redis.scan_iter(match=f"{config.prefix}:*", count=1000):
        await redis.delete(key)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'dispatches a turn':>17} {'script calls':>12} {'Redis µs/dispatch':>18} {'wall µs/dispatch':>17}"]
    for r in rows:
        redis_us, wall_us = r["redis_us_per_dispatch"], r["wall_us_per_dispatch"]
        lines.append(f"{r['per_turn']:>17} {r['script_calls']:>12,} {redis_us:>18.1f} {wall_us:>17.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("redis_url", help="a Redis whose user may run INFO (the embedded Redis's admin URL)")
    parser.add_argument("--dispatches", type=int, default=3000, help="per row (default 3000)")
    args = parser.parse_args()
    print(table(aio.run(measure(args.redis_url, args.dispatches))))


if __name__ == "__main__":
    main()
