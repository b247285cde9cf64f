"""Shared fixtures: one real redis-server per test session (the same code as `splitbus redis`,
so every bus test runs as the locked-down ``splitbus`` ACL user), and a fresh key prefix per test
so tests never see each other's keys. ``redis_admin`` has every right on that server."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.runs import CellRun
from splitbus.redis_cluster import EmbeddedCluster
from splitbus.redis_server import EmbeddedRedis
from tests.bus.slots import watch_slots

# Every `up` and `api` a test starts runs one API process unless the test asks for more: the
# default, one per core, would double the API's start-up in every end-to-end test on a CI host.
# The several-process path has its own tests (tests/api/test_processes.py,
# tests/e2e/test_api_processes.py), which pass their counts explicitly.
os.environ.setdefault("SPLITBUS_API_WORKERS", "1")


@pytest.fixture(autouse=True)
def one_slot_per_command(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every script and multi-stream read an asyncio client sends in a test (this process's) has
    its keys in one hash slot, as Redis Cluster requires: checked on the command as packed for
    the wire, and reported at the test's end (an error raised inside the bus would be retried by
    its loops, not seen)."""
    crossing = watch_slots(monkeypatch)
    yield
    assert crossing == [], f"commands whose keys span hash slots: {crossing[:3]}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    """A loopback Redis Cluster for the session: 3 primaries with a replica each, AOF on, the
    same passwords and ACL rules as ``redis_server``, TLS on every port with its own CA, as ``up
    --redis-cluster`` runs it (so it needs a redis-server built with TLS: Debian's, which .ci/run
    installs). Started only by the tests that ask for it, in ~1-2 s. A test that kills or
    restarts nodes starts a cluster of its own instead."""
    cluster = EmbeddedCluster(tmp_path_factory.mktemp("redis-cluster"), primaries=3, replicas=1)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(params=["redis", "cluster"])
def bus_environ(request: pytest.FixtureRequest) -> dict[str, str]:
    """For an end-to-end test that runs on both: ``start_system``'s ``environ``, empty for
    ``up``'s own single embedded Redis, or the session cluster's ``SPLITBUS_REDIS_URL`` (its
    keys flushed first, so that the test sees only its own system's)."""
    if request.param == "redis":
        return {}
    cluster: EmbeddedCluster = request.getfixturevalue("redis_cluster")
    admin = cluster.client(admin=True)
    try:
        admin.flushall(target_nodes=admin.PRIMARIES)
    finally:
        admin.close()
    return {"SPLITBUS_REDIS_URL": cluster.url}


@pytest.fixture
def redis_admin(redis_server: EmbeddedRedis) -> Iterator[sync_redis.Redis]:
    """A sync client as the session server's admin (``default`` user: CONFIG, INFO, ...). A test
    that changes the server's settings (CONFIG SET maxmemory) must restore them."""
    client = redis_server.admin_client(decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def bus_config(redis_server: EmbeddedRedis) -> BusConfig:
    return BusConfig(redis_url=redis_server.url, prefix=f"t{uuid.uuid4().hex[:10]}", block_ms=200)


@pytest.fixture
async def redis(bus_config: BusConfig) -> AsyncIterator[aioredis.Redis]:
    """The bus's asyncio client, its cell settled on the server's run (as a scheduler does on a
    fresh bus), so that a test's dispatches go out."""
    client = connect(bus_config)
    await CellRun(client, bus_config.keys).settle()
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer-only model folder: byte-level tokenizer, ChatML template, 512-token context."""
    import json

    from splitbus.tokenization.byte_level import write_byte_level_tokenizer

    folder = tmp_path_factory.mktemp("models") / "tiny"
    vocab = write_byte_level_tokenizer(folder)
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512, "vocab_size": vocab}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which a plain ``mkdir`` makes 0755 folders (restored after)."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
