"""A DP group's plan stream against a real Redis: every post reads back as written, and an
entry of no known shape (forged, or from a newer version) is skipped while the cursor moves on."""

from __future__ import annotations

from typing import cast

import pytest
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from splitbus.bus.core.config import BusConfig
from splitbus.bus.dp import MAX_PLAN_BYTES, ExpertStore, PlanStream, StoreAddress


async def test_every_post_reads_back_as_written(redis: aioredis.Redis, bus_config: BusConfig) -> None:
    stream = PlanStream(redis, bus_config.keys, "g")
    await stream.join(1000, 1)
    pipe = redis.pipeline(transaction=False)
    stream.queue_plan(pipe, 1000, 7, b'{"rank": 1}')
    await pipe.execute()
    await stream.done(1000, 7, 1)
    await stream.wake(1000, 0)
    last, posts = await stream.read("0-0", 0.1)
    assert [(p.epoch, p.kind, p.rank, p.step, p.plan) for p in posts] == [
        (1000, "join", 1, -1, b""),
        (1000, "plan", -1, 7, b'{"rank": 1}'),
        (1000, "done", 1, 7, b""),
        (1000, "wake", 0, -1, b""),
    ]
    assert last == posts[-1].entry_id
    assert await stream.read(last, 0.01) == (last, [])


@pytest.mark.parametrize(
    "fields",
    [
        {"join": 1},  # no epoch
        {"epoch": "-5", "join": 1},
        {"epoch": "1000", "join": "1e9"},
        {"epoch": "9" * 40, "join": 1},
        {"epoch": "1000", "done": 3},  # no rank
        {"epoch": "1000", "step": 1, "plan": b"x" * (MAX_PLAN_BYTES + 1)},
        {"epoch": "1000", "something": "else"},
    ],
)
async def test_an_entry_of_no_known_shape_is_skipped(
    redis: aioredis.Redis, bus_config: BusConfig, fields: dict[FieldT, EncodableT]
) -> None:
    stream = PlanStream(redis, bus_config.keys, "g")
    forged = cast(bytes, await redis.xadd(bus_config.keys.dp("g"), fields)).decode()
    await stream.wake(1000, 0)
    last, posts = await stream.read("0-0", 0.1)
    assert [p.kind for p in posts] == ["wake"] and posts[0].entry_id != forged
    assert last == posts[0].entry_id


async def test_ranks_read_rank_0s_expert_store_only_for_their_epoch(
    redis: aioredis.Redis, bus_config: BusConfig
) -> None:
    store = ExpertStore(redis, bus_config.keys, "g")
    assert await store.read(1000) is None  # nothing posted yet
    await store.post(StoreAddress(1000, "127.0.0.1", 29500), ttl_s=60)
    assert await store.read(1000) == StoreAddress(1000, "127.0.0.1", 29500)
    assert await store.read(2000) is None  # another run's epoch: never joined
    assert 0 < await redis.ttl(bus_config.keys.ep_store("g")) <= 60


@pytest.mark.parametrize(
    "raw", [b"1000 127.0.0.1", b"1000 127.0.0.1 0", b"1000 127.0.0.1 70000", b"-1 h 5", b"1000  5", b"\xff 1 2"]
)
async def test_an_unreadable_expert_store_address_is_ignored(
    redis: aioredis.Redis, bus_config: BusConfig, raw: bytes
) -> None:
    await redis.set(bus_config.keys.ep_store("g"), raw)
    assert await ExpertStore(redis, bus_config.keys, "g").read(1000) is None
