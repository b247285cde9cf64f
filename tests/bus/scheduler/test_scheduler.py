"""The dp-mode scheduler's stagger window against a real Redis: where it reads the group's step end."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from splitbus.bus.config import BusConfig
from splitbus.bus.registry import Registry, WorkerLoad, WorkerRecord
from splitbus.bus.scheduler.config import SchedulerConfig
from splitbus.bus.scheduler.scheduler import Scheduler
from splitbus.bus.scheduler.stagger import RELEASE_LEAD_S


@pytest.fixture
async def scheduler(bus_config: BusConfig) -> AsyncIterator[Scheduler]:
    scheduler = Scheduler(SchedulerConfig(bus_config, mode="dp"))
    yield scheduler
    await scheduler.redis.aclose()


async def _ranks(redis: aioredis.Redis, bus_config: BusConfig, ends_ms: list[int]) -> None:
    registry = Registry(redis, bus_config)
    for rank, end_ms in enumerate(ends_ms):
        record = WorkerRecord(worker_id=f"g0-r{rank}", role="mixed", model="tiny", engine="sim", dp_group="g0", dp_rank=rank, dp_size=len(ends_ms))
        await registry.register(record, lease_ms=5000)
        await registry.report_load(record.worker_id, WorkerLoad(forward_ends_ms=end_ms))


async def test_window_closes_just_before_the_slowest_rank_ends(redis: aioredis.Redis, bus_config: BusConfig, scheduler: Scheduler) -> None:
    now_ms = int(time.time() * 1000)
    await _ranks(redis, bus_config, [now_ms + 30, now_ms + 120])  # a decode and a long prefill
    await scheduler.view.refresh()
    expected = time.monotonic() + 0.12 - RELEASE_LEAD_S
    assert await scheduler.next_boundary() == pytest.approx(expected, abs=0.02)


async def test_a_group_that_has_not_stepped_gives_a_boundary_already_past(redis: aioredis.Redis, bus_config: BusConfig, scheduler: Scheduler) -> None:
    await _ranks(redis, bus_config, [0, 0])  # ranks that have not stepped yet
    await scheduler.view.refresh()
    assert await scheduler.next_boundary() < time.monotonic()
