"""The DP group's barrier on a real Redis: plans are exchanged per step, steps can end
together, and an idle group wakes when one of its ranks gets work."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from splitbus.bus.config import BusConfig
from splitbus.worker.dp import GroupBarrier, GroupBroken, StepPlan

BOUND_S = 5.0
"""Far beyond any wait here: a barrier that misses a post would show as a timeout, not a hang."""


def barriers(redis: aioredis.Redis, bus_config: BusConfig, group: str, size: int) -> list[GroupBarrier]:
    ranks = [GroupBarrier(redis, bus_config, group, rank, size, timeout_s=BOUND_S) for rank in range(size)]
    for barrier in ranks:
        barrier.begin(epoch_ms=1)
    return ranks


async def test_every_rank_gets_every_plan_of_a_step(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    ranks = barriers(redis, bus_config, "exchange", 3)
    plans = [StepPlan(r.rank, prefill=r.rank == 1, decode=False, waited_ms=0.0) for r in ranks]
    seen = await asyncio.gather(*(r.exchange(0, p) for r, p in zip(ranks, plans)))
    assert seen == [plans] * 3


async def test_an_idle_rank_wakes_when_another_rank_nudges(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    idle, busy = barriers(redis, bus_config, "nudge", 2)
    waiting = asyncio.create_task(idle.wait_for_news(BOUND_S))
    await asyncio.sleep(0.05)  # the read is blocked by now
    assert not waiting.done()
    await busy.nudge()
    await asyncio.wait_for(waiting, BOUND_S / 2)  # woken by the nudge, not by its own timeout


async def test_a_nudge_is_not_taken_for_a_plan(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    first, second = barriers(redis, bus_config, "mixed", 2)
    await first.nudge()
    plans = [StepPlan(0, True, False, 0.0), StepPlan(1, False, True, 0.0)]
    seen = await asyncio.gather(first.exchange(0, plans[0]), second.exchange(0, plans[1]))
    assert seen == [plans, plans]


async def test_a_step_ends_when_every_rank_has_finished_it(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    fast, slow = barriers(redis, bus_config, "finish", 2)
    fast_done = asyncio.create_task(fast.finish(7))
    await asyncio.sleep(0.05)
    assert not fast_done.done()  # the slow rank is still in its forward
    await slow.finish(7)
    await asyncio.wait_for(fast_done, BOUND_S / 2)


async def test_a_rank_that_never_finishes_breaks_the_group(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    (alone, _) = [GroupBarrier(redis, bus_config, "gone", rank, 2, timeout_s=0.3) for rank in range(2)]
    alone.begin(epoch_ms=1)
    message = r"^DP group gone is broken: rank\(s\) \[1\] did not finish step 3 within 0\.3s$"
    with pytest.raises(GroupBroken, match=message):  # the configured timeout, as given
        await alone.finish(3)
