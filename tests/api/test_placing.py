"""Dispatch from the API node against a real Redis: two API nodes placing at once spread their
requests over the workers (each sees the other's reservations through the registry log, and
picks at random among near-equal workers) and dispatch each once."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from splitbus.api.placing import ApiPlacer
from splitbus.bus.core.config import BusConfig
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.records import WorkerLoad
from splitbus.bus.registry import Registry, WorkerRecord
from splitbus.bus.registry_view import RegistryView

WORKERS = 8
REQUESTS = 200


async def _placer(redis: aioredis.Redis, bus: BusConfig, node: str) -> ApiPlacer:
    view = RegistryView(Registry(redis, bus), redis)
    await view.refresh()
    return ApiPlacer(redis, bus, view, "splitwise", node)


async def _follow(placers: list[ApiPlacer], stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.gather(*(p.view.follow() for p in placers))


async def test_two_api_nodes_spread_their_requests_and_dispatch_each_once(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    registry = Registry(redis, bus_config)
    load = WorkerLoad(free_kv_blocks=100_000, total_kv_blocks=100_000)
    for i in range(WORKERS):
        for role in ("prefill", "decode"):
            await registry.register(WorkerRecord(f"{role[0]}{i}", role, "tiny", "sim", load=load), 10_000)
    placers = [await _placer(redis, bus_config, f"api-{n}") for n in range(2)]
    stop = asyncio.Event()
    following = asyncio.create_task(_follow(placers, stop))
    try:

        async def send(i: int) -> bool:
            request = GenerateRequest(
                f"r{i}-{uuid.uuid4().hex[:6]}", "tiny", [97] * 64, SamplingParams(max_tokens=8), "api", 0
            )
            return await placers[i % 2].place(request)

        assert all(await asyncio.gather(*(send(i) for i in range(REQUESTS))))
    finally:
        stop.set()
        await following
    tasks = {
        role: [await redis.xlen(bus_config.keys.tasks(f"{role[0]}{i}")) for i in range(WORKERS)]
        for role in ("prefill", "decode")
    }
    assert sum(tasks["prefill"]) == sum(tasks["decode"]) == REQUESTS  # each dispatched once
    for counts in tasks.values():
        assert max(counts) <= 1.5 * REQUESTS / WORKERS, tasks  # not herded onto one worker
