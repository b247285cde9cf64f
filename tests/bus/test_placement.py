"""Reader tags placed per primary (docs/cluster.md): the slot map's numbering and tag search, an
API process's shards on every primary of the loopback cluster, several API processes' single
shards on distinct primaries, and a single Redis's names as they were."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from splitbus.bus.core.cluster import SlotMap
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.messages.results import Finished, TokenDelta
from splitbus.bus.results import ResultReader, ResultWriter, Subscription
from splitbus.redis_cluster import EmbeddedCluster, slot_ranges


def _slots(order: list[str]) -> dict[int, list[SimpleNamespace]]:
    """A ``slots_cache`` of len(order) primaries as redis-cli splits the slots, range k served by
    ``order[k]`` (and a replica after it)."""
    return {
        slot: [SimpleNamespace(name=order[k]), SimpleNamespace(name=f"replica-{k}")]
        for k, (low, high) in enumerate(slot_ranges(len(order)))
        for slot in range(low, high + 1)
    }


def test_a_slot_map_numbers_primaries_by_their_lowest_slot_and_finds_a_tag_on_each() -> None:
    slots = SlotMap.of(_slots(["n:7002", "n:7000", "n:7001"]))  # the names' order is not the slots'
    assert slots.primaries == 3
    ranges = slot_ranges(3)
    for tag in ("api-1.out.0", "api-2.out.0", "x"):
        assert slots.owner(tag) == next(k for k, (lo, hi) in enumerate(ranges) if lo <= key_slot(tag.encode()) <= hi)
    for primary in range(3):
        tag = slots.tag_on("api-1.out.0", primary)
        assert slots.owner(tag) == primary
        assert tag == "api-1.out.0" or tag.startswith("api-1.out.0-")
    here = slots.owner("api-1.out.0")
    assert slots.tag_on("api-1.out.0", here) == "api-1.out.0"  # already there: the name as it was
    assert slots.tag_on("api-1.out.0", 7) == "api-1.out.0"  # no such primary: hashed as before


def test_a_slot_no_primary_serves_belongs_to_none() -> None:
    cache = _slots(["a", "b"])
    for slot in range(100):
        del cache[slot]
    slots = SlotMap.of(cache)
    assert slots.owners[:100] == (-1,) * 100 and slots.owners[100] == 0 and slots.primaries == 2


@pytest.fixture
def cluster_config(redis_cluster: EmbeddedCluster) -> BusConfig:
    return BusConfig(redis_url=redis_cluster.url, prefix=f"t{uuid.uuid4().hex[:10]}", block_ms=200)


@pytest.fixture
async def cluster_redis(cluster_config: BusConfig) -> AsyncIterator[aioredis.Redis]:
    client = connect(cluster_config, name="t-placement")
    yield client
    await client.aclose()


def _primary_ports(cluster: EmbeddedCluster, config: BusConfig, names: list[str]) -> list[int]:
    """The port of the primary that serves each shard's wake stream and result streams."""
    ports = []
    for name in names:
        (port,) = {cluster.primary_of(key).port for key in (config.keys.wake(name), config.keys.out(name, "r"))}
        ports.append(port)
    return ports


async def _round_trip(reader: ResultReader, config: BusConfig, redis: aioredis.Redis, rids: list[str]) -> None:
    """Every request's stream, written to the shard ``reader_of`` names, reaches its subscriber."""
    subs = [await reader.subscribe(rid) for rid in rids]
    writer = ResultWriter(redis, config)
    for rid in rids:
        writer.open(rid, reader=reader.reader_of(rid))
        writer.tokens(rid, [7])
        writer.finish(rid, "stop", 1, 1)
    await writer.flush()

    async def drain(sub: Subscription) -> list[object]:
        return [r async for r in sub]

    got = await asyncio.wait_for(asyncio.gather(*map(drain, subs)), 20)
    assert [[type(r) for r in results] for results in got] == [[TokenDelta, Finished]] * len(rids)


async def test_one_apis_shards_land_on_every_primary_by_default(
    redis_cluster: EmbeddedCluster, cluster_config: BusConfig, cluster_redis: aioredis.Redis
) -> None:
    reader = ResultReader(cluster_config, cluster_redis, name="api-p.out", shards=None)
    await reader.start()
    try:
        names = reader.names
        assert len(names) == reader.connections == 3  # one shard per primary
        assert all(name == f"api-p.out.{i}" or name.startswith(f"api-p.out.{i}-") for i, name in enumerate(names))
        assert len(set(_primary_ports(redis_cluster, cluster_config, names))) == 3
        assert int(await cluster_redis.get(cluster_config.keys.readers)) == 3  # its turns, taken
        await _round_trip(reader, cluster_config, cluster_redis, [f"r{i}" for i in range(12)])
    finally:
        await reader.close()


async def test_three_apis_of_one_shard_each_land_on_three_primaries(
    redis_cluster: EmbeddedCluster, cluster_config: BusConfig, cluster_redis: aioredis.Redis
) -> None:
    """Started at once, as three API processes would be (each its own client); a fourth, left
    hashed (``placed=False``), keeps its name."""
    clients = [connect(cluster_config, name=f"t-api-{k}") for k in range(3)]
    readers = [ResultReader(cluster_config, c, name=f"api-{k}.out", shards=1) for k, c in enumerate(clients)]
    hashed = ResultReader(cluster_config, cluster_redis, name="api-h.out", placed=False)
    await asyncio.gather(*(r.start() for r in (*readers, hashed)))
    try:
        names = [r.names[0] for r in readers]
        assert len(set(_primary_ports(redis_cluster, cluster_config, names))) == 3, names
        assert hashed.names == ["api-h.out.0"]
        await _round_trip(readers[1], cluster_config, clients[1], ["a", "b"])
    finally:
        for r in (*readers, hashed):
            await r.close()
        for c in clients:
            await c.aclose()


@pytest.mark.parametrize("shards, names", [(None, ["api-s.out.0"]), (2, ["api-s.out.0", "api-s.out.1"])])
async def test_on_a_single_redis_the_names_are_as_they_were(
    bus_config: BusConfig, redis: aioredis.Redis, shards: int | None, names: list[str]
) -> None:
    reader = ResultReader(bus_config, redis, name="api-s.out", shards=shards)
    await reader.start()
    try:
        assert reader.names == names
        assert await redis.exists(bus_config.keys.readers) == 0  # no turn taken: no command added
        await _round_trip(reader, bus_config, redis, ["x", "y", "z"])
    finally:
        await reader.close()
