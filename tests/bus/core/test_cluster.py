"""The bus's client on a Redis Cluster and on a single Redis: the ``redis+cluster://`` URL,
the factory, scripts in pipelines, reads sent to their slot's primary, a failover."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import NoScriptError

from splitbus.bus.core import cluster
from splitbus.bus.core.batching import Batcher
from splitbus.bus.core.cluster import ClusterUrl, parse_cluster_url
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect, connect_sync, is_transient
from splitbus.bus.core.streams import GroupConsumer, Producer
from splitbus.bus.messages import ControlCommand
from splitbus.bus.results import ResultWriter, read_sent
from splitbus.cli.redis_cli_cmd import connection_options
from splitbus.masking import mask_url
from splitbus.redis_cluster import ClusterNodeServer, EmbeddedCluster, parse_nodes
from splitbus.redis_server import EmbeddedRedis
from tests.test_redis_cluster import _wait_replicated

SECRET = "s3cr%40t%2Fx"  # the URL form of "s3cr@t/x": "@" and "/" percent-encoded


# --- the URL --------------------------------------------------------------------------------


def test_a_cluster_url_names_its_nodes_user_and_password() -> None:
    url = parse_cluster_url(f"redis+cluster://splitbus:{SECRET}@10.0.0.1:7000,node-b.local:7001,[::1]:7002,c/0")
    assert url.nodes == (("10.0.0.1", 7000), ("node-b.local", 7001), ("::1", 7002), ("c", 6379))
    assert (url.username, url.password) == ("splitbus", "s3cr@t/x")
    assert "s3cr" not in repr(url)
    assert parse_cluster_url("REDIS+CLUSTER://h:1") == ClusterUrl(nodes=(("h", 1),))


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://",
        "redis+cluster://u:pw@",
        "redis+cluster://u:pw@h:1,,h:2",
        "redis+cluster://u:pw@h:0",
        "redis+cluster://u:pw@h:65536",
        "redis+cluster://u:pw@h:port",
        "redis+cluster://u:pw@bad_host:1",
        "redis+cluster://u:pw@h:1/2",
        "redis+cluster://u:pw@h:1?ssl=true",
        "redis://u:pw@h:1",
    ],
)
def test_a_malformed_cluster_url_is_refused_without_its_password(url: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_cluster_url(url)
    assert "pw" not in str(refused.value)


def test_the_bus_config_refuses_a_malformed_cluster_url_at_once() -> None:
    with pytest.raises(ValueError, match="host:port"):
        BusConfig(redis_url="redis+cluster://u:pw@h:1,h:x")
    config = BusConfig(redis_url=f"redis+cluster://u:{SECRET}@h:1")
    assert config.redis_url.endswith("@h:1") and SECRET not in repr(config)


def test_the_password_of_a_cluster_url_is_masked() -> None:
    assert mask_url(f"redis+cluster://splitbus:{SECRET}@h:1,h:2") == "redis+cluster://splitbus:***@h:1,h:2"


def test_redis_cli_gets_the_first_node_in_cluster_mode_and_the_password_apart() -> None:
    options, password = connection_options(f"redis+cluster://splitbus:{SECRET}@h:7000,h:7001")
    assert options == ["-c", "-h", "h", "-p", "7000", "--user", "splitbus"]
    assert password == "s3cr@t/x"


# --- the factory ----------------------------------------------------------------------------


@pytest.fixture
def cluster_config(redis_cluster: EmbeddedCluster) -> BusConfig:
    return BusConfig(redis_url=redis_cluster.url, prefix=f"t{uuid.uuid4().hex[:10]}", block_ms=200)


@pytest.fixture
async def cluster_redis(cluster_config: BusConfig) -> AsyncIterator[aioredis.Redis]:
    client = connect(cluster_config, name="t-cluster")
    yield client
    await client.aclose()


@pytest.fixture(params=["single", "cluster"])
def either_config(request: pytest.FixtureRequest) -> BusConfig:
    """The same test on the session's single Redis and on its cluster."""
    if request.param == "single":
        server: EmbeddedRedis = request.getfixturevalue("redis_server")
        return BusConfig(redis_url=server.url, prefix=f"t{uuid.uuid4().hex[:10]}", block_ms=200)
    return request.getfixturevalue("cluster_config")


@pytest.fixture
async def either(either_config: BusConfig) -> AsyncIterator[aioredis.Redis]:
    client = connect(either_config)
    yield client
    await client.aclose()


async def test_a_single_redis_url_gives_the_single_client(either_config: BusConfig, either: aioredis.Redis) -> None:
    on_cluster = either_config.redis_url.startswith(("redis+cluster://", "rediss+cluster://"))
    assert isinstance(either, aioredis.RedisCluster) is on_cluster
    assert (cluster.as_cluster(either) is not None) is on_cluster


async def test_a_cluster_client_writes_and_reads_keys_on_every_primary(
    redis_cluster: EmbeddedCluster, cluster_config: BusConfig, cluster_redis: aioredis.Redis
) -> None:
    keys = [f"{cluster_config.prefix}:{{k{i}}}" for i in range(30)]
    assert len({redis_cluster.primary_of(key).port for key in keys}) == 3
    for i, key in enumerate(keys):
        await cluster_redis.set(key, i)
    assert [int(await cluster_redis.get(key)) for key in keys] == list(range(30))
    assert await cluster_redis.delete(*keys) == 30  # a multi-key DEL outside a pipeline: split by slot


async def test_commands_beyond_the_pool_wait_for_a_connection_as_on_a_single_redis(
    cluster_config: BusConfig,
) -> None:
    """Two connections per node, eight blocking reads and eight pipelines on one node at once:
    they wait their turn (redis-py alone raises MaxConnectionsError for the third, and a pipeline
    that meets it closes every connection of the client)."""
    client = connect(cluster_config, max_connections=2)
    tag = f"{cluster_config.prefix}:{{crowd}}"
    try:
        await client.xadd(f"{tag}:s", {"n": "1"})
        pipes = [client.pipeline(transaction=False).incr(f"{tag}:n").xlen(f"{tag}:s") for _ in range(8)]
        reads = [cluster.xread(client, {f"{tag}:s": "$"}, 1, 50) for _ in range(8)]
        replies = await asyncio.gather(*reads, *(pipe.execute() for pipe in pipes))
        assert replies[:8] == [[]] * 8  # nothing new: each waited its 50 ms
        assert sorted(n for n, _ in replies[8:]) == list(range(1, 9))
    finally:
        await client.aclose()


def test_the_sync_factory_reads_a_cluster_url(redis_cluster: EmbeddedCluster, redis_server: EmbeddedRedis) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    names = [f"{prefix}:{{k{i}}}" for i in range(12)]  # on every primary
    with connect_sync(redis_cluster.url, decode_responses=True, socket_timeout=3) as client:
        assert isinstance(client, redis.RedisCluster)
        for name in names:
            client.set(name, "1")
        assert sorted(client.scan_iter(match=f"{prefix}:*")) == sorted(names)  # SCAN on every primary
    with connect_sync(redis_server.url) as single:
        assert type(single) is redis.Redis and single.ping()


# --- scripts in pipelines -------------------------------------------------------------------

_SWAP = "redis.call('SET', KEYS[1], ARGV[1]); redis.call('SET', KEYS[2], ARGV[2]); return {}"


async def test_a_batcher_runs_scripts_on_single_slot_keys_and_reports_noscript(
    either_config: BusConfig, either: aioredis.Redis
) -> None:
    """``evalsha`` in a Batcher pipeline: routed by its keys on a cluster; a script the server
    does not have comes back as NOSCRIPT to the caller, who loads it (``AsyncScript``, on every
    primary) and runs it again, as ``DispatchScript._run`` does."""
    script = either.register_script(_SWAP.replace("{}", f"'{uuid.uuid4().hex}'"))  # new: loaded nowhere yet
    batcher = Batcher(either)
    calls = [[f"{either_config.prefix}:{{c{i}}}:a", f"{either_config.prefix}:{{c{i}}}:b"] for i in range(12)]
    with pytest.raises(NoScriptError):
        await batcher.call("evalsha", script.sha, 2, *calls[0], "x", "y")
    await script(keys=calls[0], args=["x", "y"])
    replies = await asyncio.gather(
        *(batcher.call("evalsha", script.sha, 2, *keys, i, -i) for i, keys in enumerate(calls))
    )
    assert len(replies) == 12
    assert [int(await either.get(keys[1])) for keys in calls] == [-i for i in range(12)]


async def test_a_result_writer_step_over_many_readers_is_written_exactly(
    either_config: BusConfig, either: aioredis.Redis
) -> None:
    """One step for requests of six readers (six slots, on every primary of the cluster): one
    ``write_step`` per reader, in one pipeline."""
    writer = ResultWriter(either, either_config)
    requests = [(f"api-{i % 6}.out.0", f"r{i}") for i in range(24)]
    for reader, rid in requests:
        writer.open(rid, reader=reader)
        writer.tokens(rid, [1, 2])
        writer.tokens(rid, [3])
        writer.finish(rid, "stop", 4, 3)
    await writer.flush()
    assert writer.pending == 0
    assert writer.scripts in (6, 12)  # 12: the server had not got the script yet (NOSCRIPT, loaded, sent again)
    for reader, rid in requests:
        sent = await read_sent(either, either_config, reader, rid)
        assert (sent.tokens, sent.next_seq, sent.ended) == ([1, 2, 3], 3, True)
        assert 0 < await either.ttl(either_config.keys.out(reader, rid)) <= either_config.finished_result_ttl_s


async def test_a_cluster_that_lost_its_scripts_gets_them_again_on_the_next_flush(
    redis_cluster: EmbeddedCluster, cluster_config: BusConfig, cluster_redis: aioredis.Redis
) -> None:
    writer = ResultWriter(cluster_redis, cluster_config)
    readers = [f"api-{i}.out.0" for i in range(6)]
    assert len({redis_cluster.primary_of(cluster_config.keys.out(reader, "x")).port for reader in readers}) == 3
    with redis_cluster.client(admin=True) as admin:
        admin.script_flush()  # every primary: as after a restart that lost them
        for reader in readers:
            writer.open(f"after-{reader}", reader=reader)
            writer.tokens(f"after-{reader}", [2])
        await writer.flush()
        assert all(admin.script_exists(writer._writes.sha))  # loaded on every primary again
    for reader in readers:
        assert (await read_sent(cluster_redis, cluster_config, reader, f"after-{reader}")).tokens == [2]


# --- blocking reads at their slot's primary -------------------------------------------------


def _command_calls(cluster_: EmbeddedCluster) -> int:
    """COMMAND calls (GETKEYS included) served by the cluster's nodes so far."""
    total = 0
    for node in cluster_.live_nodes():
        stats = node.admin().info("commandstats")
        total += sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_command"))
    return total


async def test_blocking_reads_go_to_their_primary_without_command_getkeys(
    redis_cluster: EmbeddedCluster, cluster_config: BusConfig, cluster_redis: aioredis.Redis
) -> None:
    """redis-py routes XREAD and XREADGROUP (movable keys) with two COMMAND GETKEYS each; sent to
    their node, none (docs/cluster.md)."""
    tag = f"{cluster_config.prefix}:{{shard}}"
    streams = {f"{tag}:wake": "0-0", f"{tag}:out:r1": "0-0"}
    await cluster_redis.xadd(f"{tag}:out:r1", {"n": "1"})
    await cluster.xread(cluster_redis, dict(streams), 10, 50)  # the client has read the slot map
    before = _command_calls(redis_cluster)
    for _ in range(5):
        reply = await cluster.xread(cluster_redis, dict(streams), 10, 50)
        assert [key for key, _ in reply] == [f"{tag}:out:r1".encode()]
    consumer = GroupConsumer(cluster_redis, cluster_config, cluster_config.keys.tasks("w1"), "g", "c1")
    await consumer.ensure_group()
    await Producer(cluster_redis, cluster_config).send(consumer.stream, ControlCommand("t1", "stats", {}))
    deliveries = await consumer.read(5, block_ms=50) + await consumer.read(5, block_ms=50)
    assert [type(d.message) for d in deliveries] == [ControlCommand]
    assert _command_calls(redis_cluster) == before


async def test_a_read_at_the_primary_follows_a_slot_that_moved(
    redis_cluster: EmbeddedCluster, cluster_config: BusConfig, cluster_redis: aioredis.Redis
) -> None:
    """The client's slot map says the old primary: it answers MOVED, redis-py follows it and
    patches the map, so the read succeeds and the next one goes to the new primary directly."""
    stream = f"{cluster_config.prefix}:{{moving}}:out"
    await cluster_redis.xadd(stream, {"n": "1"})
    await cluster.xread(cluster_redis, {stream: "0-0"}, 10, 10)
    slot = key_slot(stream.encode())
    source = redis_cluster.primary_of_slot(slot)
    target = next(node for node in redis_cluster.nodes if node.port != source.port and _serves_slots(node))
    redis_cluster.begin_slot_move(slot, target)
    redis_cluster.migrate_keys(source, target, [stream])
    redis_cluster.end_slot_move(slot, target)
    try:
        for _ in range(2):
            reply = await cluster.xread(cluster_redis, {stream: "0-0"}, 10, 10)
            assert [fields for _, fields in reply[0][1]] == [{b"n": b"1"}]
        assert cluster_redis.get_node_from_key(stream).port == target.port  # type: ignore[attr-defined]
    finally:
        redis_cluster.wait_healthy(30)


def _serves_slots(node: ClusterNodeServer) -> bool:
    return any(row.slot_count for row in parse_nodes(node.cluster("NODES")) if "myself" in row.flags)


# --- a failover -----------------------------------------------------------------------------


async def test_reads_at_the_primary_follow_a_failover(tmp_path: Path) -> None:
    """A client made before a ``kill -9`` of the primary its reads go to: they fail (transient
    errors, which the bus's loops back off from) until the replica takes over, then the same
    client's reads go to the new primary and see every write that had replicated."""
    with EmbeddedCluster(tmp_path, primaries=3, replicas=1, node_timeout_ms=1000) as embedded:
        config = BusConfig(redis_url=embedded.url, prefix="t-fo", block_ms=100)
        client = connect(config, name="t-failover")
        try:
            stream = "t-fo:{victim}:out"
            victim = embedded.primary_of(stream)
            (replica,) = embedded.replicas_of(victim)
            for i in range(50):
                await client.xadd(stream, {"i": i})
            await cluster.xread(client, {stream: "0-0"}, 100, 10)
            _wait_replicated(victim, replica)
            victim.kill()
            reply, errors = await _read_until_served(client, stream)
            assert embedded.primary_of(stream) is replica
            assert [int(fields[b"i"]) for _, fields in reply[0][1]] == list(range(50))
            assert errors > 0  # it did go to the killed node first
        finally:
            await client.aclose()


async def _read_until_served(client: aioredis.Redis, stream: str) -> tuple[list[Any], int]:
    deadline = time.monotonic() + 30
    errors = 0
    while time.monotonic() < deadline:
        try:
            return await cluster.xread(client, {stream: "0-0"}, 100, 10), errors
        except Exception as exc:
            assert is_transient(exc), exc
            errors += 1
            await asyncio.sleep(0.05)
    raise AssertionError("no replica took over within 30 s")
