"""The bus's cluster client (``BusCluster``) where redis-py's differs from a single Redis's under
concurrency: a full node pool waits instead of raising, and dropping the connections after a
node error leaves the ones other tasks are using to finish their command."""

from __future__ import annotations

import asyncio
import uuid
from typing import cast

import redis.asyncio as aioredis

from splitbus.bus.core import cluster
from splitbus.bus.core.cluster import BusCluster
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.redis_cluster import EmbeddedCluster


def _client(redis_cluster: EmbeddedCluster, max_connections: int) -> BusCluster:
    client = connect(BusConfig(redis_url=redis_cluster.url), max_connections=max_connections)
    assert isinstance(client, BusCluster)
    return client


async def test_a_burst_larger_than_a_node_pool_waits_for_connections(redis_cluster: EmbeddedCluster) -> None:
    client = _client(redis_cluster, max_connections=3)
    stream = f"t{uuid.uuid4().hex[:8]}:{{burst}}"
    try:
        await client.xadd(stream, {"n": "0"})  # the slot map read, as in a running part
        replies = await asyncio.gather(*(client.xadd(stream, {"n": str(i)}) for i in range(50)), return_exceptions=True)
        assert [r for r in replies if isinstance(r, BaseException)] == []  # redis-py alone: 47 MaxConnectionsError
        assert await client.xlen(stream) == 51
    finally:
        await client.aclose()


async def test_dropping_connections_after_a_node_error_spares_a_read_in_flight(redis_cluster: EmbeddedCluster) -> None:
    client = _client(redis_cluster, max_connections=8)
    stream = f"t{uuid.uuid4().hex[:8]}:{{in-flight}}"
    try:
        await client.xadd(stream, {"n": "0"})
        read = asyncio.ensure_future(cluster.xread(cast(aioredis.Redis, client), {stream: "$"}, 10, 3000))
        await asyncio.sleep(0.2)  # the XREAD is blocked on its connection
        await client.aclose()  # what redis-py does itself when a pipeline meets a ConnectionError
        await client.xadd(stream, {"n": "1"})  # the slot map is read again first
        reply = await asyncio.wait_for(read, 5)  # redis-py alone: its connection closed under it
        assert [fields for _, entries in reply for _, fields in entries] == [{b"n": b"1"}]
    finally:
        await client.aclose()
