"""``reassert``: after a new Redis run a worker makes its task's dispatch current again, unless
the request was dispatched again (or ended) meanwhile."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.dispatch import Reassertion, ReassertOutcome
from tests.bus.slots import slots


async def test_a_lost_dispatch_is_written_again(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    keys = bus_config.keys
    deadline_ms = int(time.time() * 1000) + 30_000
    reassertion = Reassertion(redis, keys, mark_ttl_s=60)
    assert await reassertion.reassert("r1", "h1", deadline_ms) is ReassertOutcome.REASSERTED
    assert await redis.get(keys.current("r1")) == b"h1"
    assert await redis.get(keys.dispatched("r1")) == b"h1"  # no entry id: a request entry finds it dispatched
    left_ms = await redis.pttl(keys.current("r1"))
    assert 30_000 < left_ms <= 90_000  # the deadline (30 s off) and the mark's window (60 s)
    assert 0 < await redis.ttl(keys.dispatched("r1")) <= 60
    assert await reassertion.reassert("r1", "h1", deadline_ms) is ReassertOutcome.REASSERTED  # idempotent


async def test_another_current_dispatch_wins(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    keys = bus_config.keys
    await redis.set(keys.current("r2"), "h-new")
    assert await Reassertion(redis, keys).reassert("r2", "h-old", 0) is ReassertOutcome.SUPERSEDED
    assert await redis.get(keys.current("r2")) == b"h-new"
    assert not await redis.exists(keys.dispatched("r2"))


async def test_an_ended_request_is_left_alone(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    """Its reader deleted the hand-off id on the final entry; the scheduler's mark stays."""
    keys = bus_config.keys
    await redis.set(keys.dispatched("r3"), "1-0", ex=60)
    assert await Reassertion(redis, keys).reassert("r3", "h3", 0) is ReassertOutcome.OVER
    assert not await redis.exists(keys.current("r3"))


async def test_without_a_deadline_the_id_lives_at_most_an_hour(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    keys = bus_config.keys
    assert await Reassertion(redis, keys).reassert("r4", "h4", 0) is ReassertOutcome.REASSERTED
    assert 3500 < await redis.ttl(keys.current("r4")) <= 3600


def test_its_keys_lie_in_one_slot(bus_config: BusConfig) -> None:
    keys = bus_config.keys
    assert len(slots([keys.current("cmpl-1"), keys.dispatched("cmpl-1")])) == 1
