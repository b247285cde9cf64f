"""The DP group's barrier on a real Redis: plans are exchanged per step, steps can end
together, and an idle group wakes when one of its ranks gets work."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
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
    seen = await asyncio.gather(*(r.exchange(0, p) for r, p in zip(ranks, plans, strict=True)))
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


class RegistryView:
    """The group's epoch as the registry shows it (0 while not every rank is live), set by the test."""

    def __init__(self, epoch_ms: int) -> None:
        self.epoch_ms = epoch_ms

    async def __call__(self) -> int:
        return self.epoch_ms


async def test_ranks_that_come_back_in_turns_form_one_epoch(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    # Rank 2 of 4 was killed and restarted while ranks 0, 1 and 3 still stepped in the old group:
    # the registry showed all four live, rank 2 the newest, so it took its own start as the epoch.
    view = RegistryView(epoch_ms=1000)
    new = [GroupBarrier(redis, bus_config, "reform", rank, 4, timeout_s=BOUND_S) for rank in range(4)]
    first = asyncio.create_task(new[2].form(view, BOUND_S))
    await asyncio.sleep(0.3)
    assert not first.done()  # the old ranks never join that epoch
    view.epoch_ms = 0  # the old group broke: its ranks left the registry
    await asyncio.sleep(0.2)
    view.epoch_ms = 2000  # they came back, each newer than rank 2
    epochs = await asyncio.wait_for(asyncio.gather(first, *(new[r].form(view, BOUND_S) for r in (0, 1, 3))), BOUND_S)
    assert epochs == [2000] * 4  # one epoch for all four (rank 2 used to stay in 1000 and break them at step 0)
    plans = [StepPlan(r, False, False, 0.0) for r in range(4)]
    seen = await asyncio.wait_for(asyncio.gather(*(new[r].exchange(0, plans[r]) for r in range(4))), BOUND_S)
    assert seen == [plans] * 4  # and they step together


async def test_a_group_that_never_forms_fails_with_a_clear_error(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    lonely = GroupBarrier(redis, bus_config, "unformed", 0, 2, timeout_s=BOUND_S)
    message = r"^DP group unformed: not all 2 ranks came up and joined one epoch within 0\.3s$"
    with pytest.raises(GroupBroken, match=message):
        await lonely.form(RegistryView(epoch_ms=1000), 0.3)


async def test_a_join_from_a_rank_the_group_lacks_forms_nothing(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    rank0 = GroupBarrier(redis, bus_config, "stray", 0, 2, timeout_s=BOUND_S)
    await redis.xadd(bus_config.keys.dp("stray"), {"epoch": 1000, "join": 5})  # a bad entry: no rank 5 in a group of 2
    with pytest.raises(GroupBroken):  # rank 1 never joined: two joins, but not from ranks 0 and 1
        await rank0.form(RegistryView(epoch_ms=1000), 0.3)
