"""The tenant store (splitbus.bus.tenants) on a real Redis: add, set, remove, a key's tenant, keys
kept hashed only, and every bad record refused with a clear error."""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any, cast

import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.tenants import (
    BadTenantRecord,
    Tenant,
    TenantError,
    TenantLimits,
    TenantStore,
    check_digest,
    check_key,
    check_name,
    key_digest,
    new_key,
    stored_tenants,
)
from splitbus.redis_cluster import EmbeddedCluster
from splitbus.redis_server import EmbeddedRedis

KEY = "sk-acme-0123456789abcdef"


@pytest.fixture
def store(redis: aioredis.Redis, bus_config: BusConfig) -> TenantStore:
    return TenantStore(redis, bus_config.keys)


async def test_a_key_finds_its_tenant_and_limits(store: TenantStore) -> None:
    assert not await store.any()
    acme = Tenant("acme", limits=TenantLimits(rps=2.5, tpm=10_000, concurrency=4, priority=-1, weight=2))
    await store.add(acme, (key_digest(KEY),))
    assert await store.any()
    assert await store.by_key(KEY.encode()) == acme
    assert await store.by_key(b"sk-nobody-0123456789") is None
    assert await store.get("acme") == acme
    assert await store.all() == [acme]
    assert await store.key_counts() == {"acme": 1}


async def test_a_name_or_key_taken_writes_nothing(store: TenantStore) -> None:
    await store.add(Tenant("acme"), (key_digest(KEY),))
    with pytest.raises(TenantError, match="a tenant named acme exists"):
        await store.add(Tenant("acme"), (key_digest("sk-other-0123456789"),))
    with pytest.raises(TenantError, match="is a tenant's already"):
        await store.add(Tenant("beta"), (key_digest("sk-beta-0123456789"), key_digest(KEY)))
    assert [t.name for t in await store.all() if isinstance(t, Tenant)] == ["acme"]
    assert await store.by_key(b"sk-beta-0123456789") is None
    with pytest.raises(TenantError, match="another tenant's"):
        await store.add(Tenant("beta"))
        await store.add_keys("beta", (key_digest(KEY),))
    with pytest.raises(TenantError, match="no tenant named gamma"):
        await store.add_keys("gamma", (key_digest("sk-gamma-0123456789"),))


async def test_set_changes_only_what_it_names_and_none_lifts_a_limit(store: TenantStore) -> None:
    acme = Tenant("acme", limits=TenantLimits(rps=1, concurrency=2))
    await store.add(acme)
    now = await store.set("acme", rps=None, weight=3.0)
    assert now == Tenant("acme", acme.id, TenantLimits(concurrency=2, weight=3.0))
    assert await store.get("acme") == now
    with pytest.raises(BadTenantRecord, match="concurrency must be in"):
        await store.set("acme", concurrency=0)
    with pytest.raises(TenantError, match="no tenant named beta"):
        await store.set("beta", rps=1)


async def test_two_operators_setting_at_once_lose_neither_change(store: TenantStore) -> None:
    await store.add(Tenant("acme"))
    await asyncio.gather(*(store.set("acme", **{field: 7}) for field in ("tpm", "prompt_tpm", "output_tpm")))
    limits = (await store.get("acme")).limits  # type: ignore[union-attr]
    assert (limits.tpm, limits.prompt_tpm, limits.output_tpm) == (7, 7, 7)


async def test_remove_takes_the_tenants_keys_and_no_others(store: TenantStore) -> None:
    await store.add(Tenant("acme"), (key_digest(KEY), key_digest("sk-acme-second-key")))
    await store.add(Tenant("beta"), (key_digest("sk-beta-0123456789"),))
    assert await store.remove("acme") == 2
    assert await store.by_key(KEY.encode()) is None
    assert await store.key_counts() == {"beta": 1}
    with pytest.raises(TenantError, match="no tenant named acme"):
        await store.remove("acme")
    await store.add(Tenant("acme"), (key_digest(KEY),))  # the name and key are free again


async def test_no_key_is_stored_in_clear(
    store: TenantStore, redis_server: EmbeddedRedis, bus_config: BusConfig
) -> None:
    key = new_key()
    await store.add(Tenant("acme", limits=TenantLimits(rps=1)), (key_digest(key),))
    # As bytes: the server may hold other tests' binary values (KV payloads), which are no UTF-8.
    raw = redis_server.admin_client()
    stored = [item for name in raw.scan_iter(match="*") for item in _everything(raw, name)]
    raw.close()
    assert not any(key.encode() in item or key[3:20].encode() in item for item in stored)
    assert key_digest(key).encode() in stored and b"acme" in stored


def _everything(client: sync_redis.Redis, name: bytes) -> list[bytes]:
    """A key's name and every value it holds (strings, hashes, sets, sorted sets, lists, streams)."""
    kind = cast(bytes, client.type(name)).decode()
    reads: dict[str, Any] = {
        "string": lambda: [client.get(name)],
        "hash": lambda: [item for pair in cast(dict[bytes, bytes], client.hgetall(name)).items() for item in pair],
        "set": lambda: list(cast(set[bytes], client.smembers(name))),
        "zset": lambda: list(cast(list[bytes], client.zrange(name, 0, -1))),
        "list": lambda: list(cast(list[bytes], client.lrange(name, 0, -1))),
        "stream": lambda: [repr(entry).encode() for entry in cast(list[Any], client.xrange(name))],
        "none": lambda: [],  # expired since the scan named it (the server is shared with other tests' keys)
    }
    return [name, *(bytes(v) for v in reads[kind]())]


@pytest.mark.parametrize(
    ("record", "error"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"x" * 2000, "at most 1024 bytes"),
        (b'{"rps": 1}', "id must be 32 hex digits"),
        (b'{"id": "' + b"a" * 32 + b'", "rps": 0}', "rps must be in"),
        (b'{"id": "' + b"a" * 32 + b'", "rps": "fast"}', "rps must be a number"),
        (b'{"id": "' + b"a" * 32 + b'", "tpm": 1.5}', "tpm must be an integer"),
        (b'{"id": "' + b"a" * 32 + b'", "concurrency": true}', "concurrency must be an integer"),
        (b'{"id": "' + b"a" * 32 + b'", "priority": 4294967296}', "priority must be in"),
        (b'{"id": "' + b"a" * 32 + b'", "weight": 1e400}', "not JSON"),
        (b'{"id": "' + b"a" * 32 + b'", "admin": true}', "unknown tenant field(s): 'admin'"),
        (b'{"id": "' + b"a" * 32 + b'", "a\\nWARNING forged": 1}', "unknown tenant field(s): 'a\\nWARNING forged'"),
    ],
)
async def test_a_bad_record_is_refused_with_a_clear_error_and_hides_no_other(
    store: TenantStore, redis_admin: sync_redis.Redis, bus_config: BusConfig, record: bytes, error: str
) -> None:
    await store.add(Tenant("good"), (key_digest("sk-good-0123456789"),))
    redis_admin.hset(bus_config.keys.tenants, "acme", record)
    redis_admin.hset(bus_config.keys.tenant_keys, key_digest(KEY), "acme")
    with pytest.raises(BadTenantRecord, match=re.escape(error)):
        await store.by_key(KEY.encode())
    bad, good = await store.all()  # by name: acme, good
    assert isinstance(bad, BadTenantRecord) and error in str(bad) and "acme" in str(bad)
    assert good == await store.by_key(b"sk-good-0123456789")
    sync_bad, sync_good = stored_tenants(redis_admin, bus_config.keys)  # `splitbus status`'s read: the same
    assert isinstance(sync_bad, BadTenantRecord) and str(sync_bad) == str(bad) and sync_good == good


async def test_a_key_of_a_tenant_with_a_bad_name_or_no_record_finds_none(
    store: TenantStore, redis_admin: sync_redis.Redis, bus_config: BusConfig
) -> None:
    redis_admin.hset(bus_config.keys.tenant_keys, key_digest(KEY), "gone")
    assert await store.by_key(KEY.encode()) is None
    redis_admin.hset(bus_config.keys.tenant_keys, key_digest(KEY), "bad name\x1b[2J")
    redis_admin.hset(bus_config.keys.tenants, "bad name\x1b[2J", Tenant("x").record())
    with pytest.raises(BadTenantRecord, match="a tenant's name is"):
        await store.by_key(KEY.encode())


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "é", "a:b", "{cell}"])
def test_a_bad_name_is_refused(name: str) -> None:
    with pytest.raises(BadTenantRecord, match="a tenant's name is"):
        check_name(name)


def test_the_start_keys_tenants_name_is_reserved() -> None:
    with pytest.raises(BadTenantRecord, match="'default' names the keys an API is started with"):
        Tenant("default")


def test_keys_and_digests_are_checked() -> None:
    assert check_key(new_key()) and len(new_key()) == 46 and new_key() != new_key()
    for bad in ("short", "has a space in it ok", "x" * 257, "ctrl\x07-0123456789ab"):
        with pytest.raises(BadTenantRecord, match="visible ASCII"):
            check_key(bad)
    assert check_digest(key_digest(KEY)) == key_digest(KEY.encode())
    with pytest.raises(BadTenantRecord, match="64 lower-case hex"):
        check_digest(key_digest(KEY).upper())


async def test_every_operation_runs_on_a_redis_cluster(redis_cluster: EmbeddedCluster) -> None:
    """Each script's keys share the cell's slot: a cluster runs them as one Redis does."""
    config = BusConfig(redis_url=redis_cluster.url, prefix=f"t{uuid.uuid4().hex[:10]}")
    client = connect(config, name="t-tenants")
    try:
        store = TenantStore(client, config.keys)
        await store.add(Tenant("acme", limits=TenantLimits(rps=1)), (key_digest(KEY),))
        await store.add_keys("acme", (key_digest("sk-acme-second-key"),))
        assert (await store.set("acme", rps=2)).limits.rps == 2
        assert (await store.by_key(KEY.encode())) == await store.get("acme")
        assert await store.any() and await store.key_counts() == {"acme": 2}
        assert await store.remove("acme") == 2 and not await store.any()
    finally:
        await client.aclose()
