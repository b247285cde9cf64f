"""The scheduler's recovery after a new Redis run: a fresh cell is settled at start, one where
workers hold requests waits out the grace first, and a loop step settles it once the grace is over."""

from __future__ import annotations

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.runs import CellRun
from splitbus.scheduler.recovery import Recovery


async def _unsettled(redis: aioredis.Redis, config: BusConfig) -> CellRun:
    await redis.delete(config.keys.run)  # what a server that lost it (or a new one) holds
    cell = CellRun(redis, config.keys)
    assert not await cell.settled()
    return cell


async def test_a_fresh_cell_is_settled_at_start(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    cell = await _unsettled(redis, bus_config)
    recovery = Recovery(redis, bus_config.keys, grace_s=60, name="s1")
    await recovery.start(holding=0)
    assert not recovery.recovering
    assert await cell.settled()


async def test_with_workers_holding_requests_the_grace_comes_first(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    cell = await _unsettled(redis, bus_config)
    waiting = Recovery(redis, bus_config.keys, grace_s=60, name="s1")
    await waiting.start(holding=2)
    assert waiting.recovering
    assert not await waiting.step()  # the grace is not over
    assert not await cell.settled()
    over = Recovery(redis, bus_config.keys, grace_s=0, name="s2")
    await over.check()  # a loop step sees the cell unsettled...
    assert over.recovering
    assert await over.step()  # ...and settles it once its grace is over
    assert not over.recovering
    assert await cell.settled()
    await waiting.check()
    assert waiting.recovering  # it still waits out its own grace; the cell is settled meanwhile
