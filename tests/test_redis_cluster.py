"""The embedded Redis Cluster (splitbus/redis_cluster.py): it comes up healthy, a redis-py cluster
client reads and writes across its slots as the locked-down ``splitbus`` user, the redis-py facts
the slot layout relies on (docs/cluster.md), a restart from its folder, and a kill -9 of a primary:
its replica takes over and the writes it had replicated are all there. The outage is printed
(``-s`` shows it) and recorded as a property, never asserted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterPipeline
from redis.crc import key_slot
from redis.exceptions import NoPermissionError, RedisClusterException

from splitbus.redis_cluster import (
    SLOTS,
    ClusterNodeServer,
    EmbeddedCluster,
    parse_nodes,
    slot_ranges,
)
from splitbus.redis_server import RedisServerError

FAILOVER_BOUND_S = 30.0
"""How long a test waits for a replica to take over before it fails (a hang guard, not a target:
with cluster-node-timeout 1000 it takes a few seconds)."""

NODES_TEXT = """\
a1 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:30002@40002 master - 0 1 2 connected 5461-10922 [10923->-c3]
c3 127.0.0.1:30003@40003 master,fail - 0 1 3 disconnected 10923-16383
d4 127.0.0.1:30004@40004 slave a1 0 1 1 connected
"""


def test_slot_ranges_split_the_slots_as_redis_cli_does() -> None:
    assert slot_ranges(3) == [(0, 5460), (5461, 10922), (10923, 16383)]
    assert slot_ranges(1) == [(0, SLOTS - 1)]
    assert sum(high - low + 1 for low, high in slot_ranges(7)) == SLOTS


def test_parse_nodes_reads_roles_links_and_slots() -> None:
    rows = {row.node_id: row for row in parse_nodes(NODES_TEXT)}
    assert rows["a1"].primary and rows["a1"].port == 30001 and rows["a1"].slot_count == 5461
    assert rows["b2"].slots == ((5461, 10922),)  # a slot migrating away is not counted twice
    assert rows["c3"].failed and rows["c3"].serves(16383)
    assert not rows["d4"].primary and rows["d4"].primary_id == "a1" and rows["d4"].slot_count == 0


@pytest.mark.parametrize(("primaries", "replicas", "timeout"), [(0, 1, 1000), (3, 5, 1000), (3, 1, 10)])
def test_a_cluster_of_impossible_shape_is_refused(tmp_path: Path, primaries: int, replicas: int, timeout: int) -> None:
    with pytest.raises(RedisServerError):
        EmbeddedCluster(tmp_path, primaries=primaries, replicas=replicas, node_timeout_ms=timeout)


def test_the_cluster_comes_up_healthy(redis_cluster: EmbeddedCluster) -> None:
    assert redis_cluster.problems() == []
    primaries = {redis_cluster.primary_of_slot(low) for low, _ in slot_ranges(3)}
    assert len(primaries) == 3
    assert {len(redis_cluster.replicas_of(primary)) for primary in primaries} == {1}
    replicas = {replica for primary in primaries for replica in redis_cluster.replicas_of(primary)}
    assert primaries | replicas == set(redis_cluster.nodes)
    for node in redis_cluster.nodes:
        assert node.admin().config_get("appendonly") == {"appendonly": "yes"}
        assert node.admin().config_get("cluster-node-timeout") == {"cluster-node-timeout": "1000"}


def test_a_cluster_client_writes_and_reads_keys_on_every_primary(redis_cluster: EmbeddedCluster) -> None:
    client = redis_cluster.client()  # the splitbus user, as the bus connects
    try:
        keys = [f"t-rw:{i}" for i in range(60)]
        for i, key in enumerate(keys):
            client.set(key, i, ex=60)
        assert [int(client.get(key)) for key in keys] == list(range(60))
        assert len({client.get_node_from_key(key).name for key in keys}) == 3
        client.xadd("t-rw:s:{api-1}:a", {"f": "1"})
        client.xadd("t-rw:s:{api-1}:b", {"f": "2"})
        reply = client.xread({"t-rw:s:{api-1}:a": "0", "t-rw:s:{api-1}:b": "0"})
        assert [key for key, _ in reply] == [b"t-rw:s:{api-1}:a", b"t-rw:s:{api-1}:b"]
    finally:
        client.close()


def test_redis_py_refuses_cross_slot_keys_before_they_reach_a_server(redis_cluster: EmbeddedCluster) -> None:
    """What docs/cluster.md builds on: one tag, one slot, one script; two tags, refused."""
    client = redis_cluster.client()
    try:
        count_keys = client.register_script("return #KEYS")
        assert count_keys(keys=["t-x:a:{cell}", "t-x:b:{cell}"]) == 2
        with pytest.raises(RedisClusterException, match="same key slot"):
            count_keys(keys=["t-x:{a}", "t-x:{b}"])
        with pytest.raises(RedisClusterException, match="same key slot"):
            client.xread({"t-x:{a}": "0", "t-x:{b}": "0"})
        for queue in (pipeline_by_name, pipeline_evalsha):  # the Batcher's scripts go by name
            pipe = client.pipeline(transaction=False)
            queue(pipe, count_keys.sha, "t-x:{a}", "t-x:{b}")
            with pytest.raises(RedisClusterException, match="same key slot"):
                pipe.execute()
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("EVALSHA", count_keys.sha, 1, "t-x:{a}")
        pipe.execute_command("EVALSHA", count_keys.sha, 1, "t-x:{b}")
        assert pipe.execute() == [1, 1]  # by name, a script in a cluster pipeline is routed by its keys
    finally:
        client.close()


def pipeline_by_name(pipe: ClusterPipeline, sha: str, *keys: str) -> None:
    pipe.execute_command("EVALSHA", sha, len(keys), *keys)


def pipeline_evalsha(pipe: ClusterPipeline, sha: str, *keys: str) -> None:
    """Refused in a cluster pipeline up to redis-py 8.1, routed by its keys as by name since 8.2."""
    pipe.evalsha(sha, len(keys), *keys)


def test_a_cluster_client_follows_a_slot_that_moves_ask_then_moved(redis_cluster: EmbeddedCluster) -> None:
    """A reshard as the splitbus user sees it: keys of a migrating slot answer ASK (redis-py sends
    ASKING, which that user may run), then MOVED once the slot has moved; no error reaches us."""
    client = redis_cluster.client()
    moved, kept = "t-mv:{slot}:a", "t-mv:{slot}:b"
    slot = key_slot(moved.encode())
    source = redis_cluster.primary_of_slot(slot)
    target = next(node for node in redis_cluster.nodes if node.port != source.port and _serves_slots(node))
    try:
        client.set(moved, "1")
        client.set(kept, "2")
        redis_cluster.begin_slot_move(slot, target)
        redis_cluster.migrate_keys(source, target, [moved])
        assert client.get(moved) == b"1"  # ASK: on the target now
        assert "cmdstat_asking" in target.admin().info("commandstats")  # redis-py sent ASKING there
        assert client.get(kept) == b"2"  # still on the source
        redis_cluster.migrate_keys(source, target, [kept])
        redis_cluster.end_slot_move(slot, target)
        assert client.get(kept) == b"2" and client.set(moved, "3")  # MOVED: the slot is the target's
        assert redis_cluster.primary_of_slot(slot) is target
    finally:
        client.close()
    redis_cluster.wait_healthy(FAILOVER_BOUND_S)


def _serves_slots(node: ClusterNodeServer) -> bool:
    return any(row.slot_count for row in parse_nodes(node.cluster("NODES")) if "myself" in row.flags)


def test_the_splitbus_user_is_locked_down_on_every_node(redis_cluster: EmbeddedCluster) -> None:
    for node in redis_cluster.nodes:
        with redis.Redis.from_url(node.url) as client:
            assert client.execute_command("CLUSTER", "SLOTS")  # what a cluster client needs
            with pytest.raises(NoPermissionError):
                client.config_get("masterauth")
            with pytest.raises(NoPermissionError):
                client.execute_command("CLUSTER", "RESET")
        password = (redis_cluster.data_dir / "replication.password").read_text().strip()
        tls = redis_cluster.client_tls.settings() if redis_cluster.client_tls else {}
        with redis.Redis(host=node.host, port=node.port, username="replicator", password=password, **tls) as client:
            with pytest.raises(NoPermissionError):
                client.get("t-lock")
    for path in redis_cluster.data_dir.rglob("redis.conf"):
        assert (redis_cluster.data_dir / "replication.password").read_text().strip() not in path.read_text()


def test_a_stopped_cluster_starts_again_from_its_folder(tmp_path: Path) -> None:
    cluster = EmbeddedCluster(tmp_path, primaries=3, replicas=1)
    cluster.start()
    try:
        ports = cluster.startup_nodes
        with cluster.client() as client:
            client.set("t-restart", "kept")
        cluster.stop()
        cluster.start()
        assert cluster.startup_nodes == ports
        with cluster.client() as client:
            assert client.get("t-restart") == b"kept"  # from the AOF of its primary
    finally:
        cluster.stop()


def _wait_replicated(primary: ClusterNodeServer, replica: ClusterNodeServer) -> None:
    """Until the replica has every byte of the primary's replication stream so far."""
    target = int(primary.admin().info("replication")["master_repl_offset"])
    deadline = time.monotonic() + FAILOVER_BOUND_S
    while int(replica.admin().info("replication").get("slave_repl_offset", -1)) < target:
        assert time.monotonic() < deadline, "the replica did not catch up"
        time.sleep(0.01)


def _async_client(cluster: EmbeddedCluster) -> AsyncRedisCluster:
    """An asyncio cluster client as the bus's clients are set (RESP2, 5 s socket timeout, two
    quick retries: ``bus.core.connection.connect``), as the ``splitbus`` user."""
    return AsyncRedisCluster(
        startup_nodes=[AsyncClusterNode(host, port) for host, port in cluster.startup_nodes],
        username="splitbus",
        password=cluster.password,
        protocol=2,
        socket_timeout=5.0,
        socket_connect_timeout=2.0,
        retry=Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.5), retries=2),
        **(cluster.client_tls.settings() if cluster.client_tls else {}),
    )


async def _write_until_served(client: AsyncRedisCluster, key: str, other: str) -> tuple[float, int]:
    """Write ``key`` until a write succeeds; (seconds it took, writes to ``other`` refused meanwhile)."""
    start = time.monotonic()
    refused = 0
    while time.monotonic() - start < FAILOVER_BOUND_S:
        try:
            await client.set(key, "after")
            return time.monotonic() - start, refused
        except (redis.RedisError, OSError):
            await asyncio.sleep(0.02)
        try:
            await client.set(other, "meanwhile")
        except (redis.RedisError, OSError):
            refused += 1
    raise AssertionError(f"no replica took over within {FAILOVER_BOUND_S} s")


async def test_a_killed_primary_is_replaced_by_its_replica_with_its_replicated_writes(
    tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    """The bus's kind of client (asyncio), made before the kill, finds the new primary by itself."""
    cluster = EmbeddedCluster(tmp_path, primaries=3, replicas=1, node_timeout_ms=1000)
    cluster.start()
    client = _async_client(cluster)
    try:
        victim = cluster.primary_of("t-fo:{v}")
        (replica,) = cluster.replicas_of(victim)
        other = next(f"t-fo:{{o{i}}}" for i in range(100) if cluster.primary_of(f"t-fo:{{o{i}}}") is not victim)
        keys = [f"t-fo:{{v}}:{i}" for i in range(200)]
        for i, key in enumerate(keys):
            await client.set(key, i)
        _wait_replicated(victim, replica)
        victim.kill()
        outage_s, refused = await _write_until_served(client, "t-fo:{v}", other)
        print(f"\nfailover: writes to the primary's slots refused {outage_s:.2f} s, {refused} to other slots refused")
        record_property("failover_outage_s", round(outage_s, 3))
        assert cluster.primary_of("t-fo:{v}") is replica
        assert [int(await client.get(key)) for key in keys] == list(range(200))
        victim.start()  # back as a replica of the node that took its place
        cluster.wait_healthy(FAILOVER_BOUND_S)
        assert cluster.replicas_of(replica) == [victim]
    finally:
        await client.aclose()
        cluster.stop()
