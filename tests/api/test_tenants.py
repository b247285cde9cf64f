"""Tenants in the API: a request's chain salt, from its tenant and cache_salt (pure logic); a key's
tenant from the store, cached, and whether keys are required (``Authenticator``, on a real Redis);
a live API taking store keys beside the keys it was started with."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import httpx
import openai
import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.types import Message, Receive, Scope, Send

from splitbus.api.app import RequireApiKey
from splitbus.api.tenants import (
    DEFAULT_TENANT,
    NO_TENANT,
    Authenticator,
    Caller,
    LookupFailed,
    cache_salt,
    tenant_of,
    tenant_of_store,
)
from splitbus.bus.blocks import HEX_DIGITS
from splitbus.bus.core import codec
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.tenants import Tenant, TenantLimits, TenantStore, key_digest
from splitbus.redis_server import EmbeddedRedis
from tests.api.conftest import ApiProcess, start_api, stop_api
from tests.api.responder import Responder
from tests.api.test_errors import _until

T = TypeVar("T")


def test_without_keys_or_cache_salt_the_chain_is_unsalted() -> None:
    assert cache_salt(NO_TENANT, None) == ""


def test_each_key_and_cache_salt_has_a_salt_of_its_own_that_shows_neither() -> None:
    a, b = tenant_of("sk-a-0123456789"), tenant_of("sk-b-0123456789")
    salts = [cache_salt(t, s) for t in (NO_TENANT, a, b) for s in (None, "x", "y")][1:]
    assert len(set(salts)) == len(salts) == 8
    assert all(len(bytes.fromhex(s)) * 2 == len(s) == HEX_DIGITS for s in salts)
    assert cache_salt(a, "x") == cache_salt(tenant_of("sk-a-0123456789"), "x")  # the same across API replicas
    assert not any("0123456789" in s or a.hex() in s for s in salts)  # neither the key nor its tenant digest


# The Authenticator: a key's tenant from the store, kept a while; whether keys are required.

STORE_KEY = "sk-acme-store-key-0123"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(redis: aioredis.Redis, bus_config: BusConfig) -> TenantStore:
    return TenantStore(redis, bus_config.keys)


async def test_a_store_key_names_its_tenant_and_limits_a_started_key_the_default(store: TenantStore) -> None:
    acme = Tenant("acme", limits=TenantLimits(rps=3, priority=2))
    await store.add(acme, (key_digest(STORE_KEY), key_digest(STORE_KEY + "-2")))
    await store.add(Tenant("beta"), (key_digest("sk-beta-store-key-0123"),))
    auth = Authenticator(("k1",), store, ttl_s=2, max_entries=100)
    await auth.watch()
    assert await auth.caller(STORE_KEY.encode()) == Caller("acme", acme.limits, tenant_of_store(acme))
    assert await auth.caller(b"k1") == Caller(DEFAULT_TENANT, TenantLimits(), tenant_of("k1"))
    identities = {(await auth.caller(key)).cache for key in (STORE_KEY.encode(), b"sk-acme-store-key-0123-2")}  # type: ignore[union-attr]
    assert len(identities) == 1  # one tenant, one cache
    others = {tenant_of("k1"), (await auth.caller(b"sk-beta-store-key-0123")).cache}  # type: ignore[union-attr]
    assert len(identities | others) == 3
    for unknown in (b"", b"k2", b"sk-nobody-0123456789", b"x" * 300):
        assert await auth.caller(unknown) is None


async def test_keys_are_required_once_the_store_has_a_tenant_and_stay_so(store: TenantStore) -> None:
    auth = Authenticator((), store, ttl_s=2, max_entries=100)
    assert auth.required  # not read yet: closed
    await auth.watch()
    assert not auth.required
    await store.add(Tenant("acme"), (key_digest(STORE_KEY),))
    await auth.watch()
    assert auth.required
    await store.remove("acme")
    await auth.watch()
    assert auth.required  # removing the last tenant does not open a running API
    assert Authenticator(("k1",), store, ttl_s=2, max_entries=100).required


async def test_an_answer_is_kept_ttl_then_read_again(store: TenantStore) -> None:
    clock = Clock()
    auth = Authenticator((), store, ttl_s=2, max_entries=100, clock=clock)
    await auth.watch()
    assert await auth.caller(STORE_KEY.encode()) is None
    await store.add(Tenant("acme", limits=TenantLimits(concurrency=1)), (key_digest(STORE_KEY),))
    assert await auth.caller(STORE_KEY.encode()) is None  # "no tenant" is kept too
    clock.now = 2.0
    assert (await auth.caller(STORE_KEY.encode())).limits.concurrency == 1  # type: ignore[union-attr]
    await store.set("acme", concurrency=5)
    await store.remove("acme")
    clock.now = 3.9
    assert (await auth.caller(STORE_KEY.encode())).limits.concurrency == 1  # type: ignore[union-attr]
    clock.now = 4.0
    assert await auth.caller(STORE_KEY.encode()) is None


async def test_a_bad_record_refuses_only_its_tenants_keys(
    store: TenantStore, redis_admin: sync_redis.Redis, bus_config: BusConfig
) -> None:
    await store.add(Tenant("good"), (key_digest("sk-good-store-key-0123"),))
    redis_admin.hset(bus_config.keys.tenants, "acme", b'{"id": "' + b"a" * 32 + b'", "rps": -1}')
    redis_admin.hset(bus_config.keys.tenant_keys, key_digest(STORE_KEY), "acme")
    auth = Authenticator((), store, ttl_s=2, max_entries=100)
    await auth.watch()
    assert await auth.caller(STORE_KEY.encode()) is None
    assert await auth.caller(b"sk-good-store-key-0123") is not None


class UnreachableStore:
    """A store whose Redis went away after ``answers`` reads."""

    def __init__(self, store: TenantStore, answers: int) -> None:
        self.store, self.answers = store, answers

    async def any(self) -> bool:
        return await self.store.any()

    async def by_digest(self, digest: str) -> Tenant | None:
        self.answers -= 1
        if self.answers < 0:
            raise RedisConnectionError("Connection refused")
        return await self.store.by_digest(digest)


async def test_while_redis_is_away_the_last_answer_stands_and_a_new_key_is_503(store: TenantStore) -> None:
    await store.add(Tenant("acme"), (key_digest(STORE_KEY),))
    clock = Clock()
    auth = Authenticator((), UnreachableStore(store, answers=1), ttl_s=2, max_entries=100, clock=clock)  # type: ignore[arg-type]
    await auth.watch()
    assert await auth.caller(STORE_KEY.encode()) is not None
    clock.now = 100.0
    assert await auth.caller(STORE_KEY.encode()) is not None
    with pytest.raises(LookupFailed, match="Connection refused"):
        await auth.caller(b"sk-never-seen-0123456789")


async def test_the_cache_is_bounded_the_least_recently_used_going_first(store: TenantStore) -> None:
    await store.add(Tenant("acme"), (key_digest(STORE_KEY),))
    reads = UnreachableStore(store, answers=3)
    auth = Authenticator((), reads, ttl_s=60, max_entries=2)  # type: ignore[arg-type]
    await auth.watch()
    await auth.caller(STORE_KEY.encode())
    await auth.caller(b"sk-unknown-0123456789-a")
    await auth.caller(STORE_KEY.encode())  # kept: no read
    await auth.caller(b"sk-unknown-0123456789-b")  # the unknown -a goes
    assert reads.answers == 0
    assert await auth.caller(STORE_KEY.encode()) is not None  # still kept
    with pytest.raises(LookupFailed):
        await auth.caller(b"sk-unknown-0123456789-a")


# A live API: keys from the store and keys given at start, side by side.


def _with_store(url: str, prefix: str, action: Callable[[TenantStore], Awaitable[T]]) -> T:
    async def main() -> T:
        config = BusConfig(redis_url=url, prefix=prefix)
        client = connect(config)
        try:
            return await action(TenantStore(client, config.keys))
        finally:
            await client.aclose()

    return asyncio.run(main())


def _status(api: ApiProcess, key: str | None, path: str = "/v1/models") -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(api.url + path, headers=headers).status_code


def test_a_live_api_takes_store_keys_beside_its_own(
    redis_server: EmbeddedRedis, tiny_model: Path, prefix: str, responder: Responder
) -> None:
    url = redis_server.url
    _with_store(url, prefix, lambda s: s.add(Tenant("acme"), (key_digest(STORE_KEY), key_digest(STORE_KEY + "-2"))))
    _with_store(url, prefix, lambda s: s.add(Tenant("beta"), (key_digest("sk-beta-store-key-0123"),)))
    api = start_api(url, prefix, [tiny_model], "--api-key", "sk-started-with-0123")
    try:
        assert [_status(api, key) for key in (None, "sk-nobody-0123456789", STORE_KEY, "sk-started-with-0123")] == [
            401,
            401,
            200,
            200,
        ]
        assert _status(api, None, "/health") == 200
        salts = {}
        for key in (STORE_KEY, STORE_KEY + "-2", "sk-beta-store-key-0123", "sk-started-with-0123"):
            client = openai.OpenAI(base_url=api.v1, api_key=key, max_retries=0)
            reply = client.completions.create(model="tiny", prompt=list(range(40)), max_tokens=2)
            (request,) = [r for r in responder.requests if r.request_id == reply.id]
            assert "store-key" not in codec.encode(request)[b"data"].decode()
            salts[key] = request.cache_salt
        assert salts[STORE_KEY] == salts[STORE_KEY + "-2"] and len(set(salts.values())) == 3
        _with_store(url, prefix, lambda s: s.remove("acme"))
        _until(lambda: _status(api, STORE_KEY) == 401)
        assert _status(api, "sk-beta-store-key-0123") == 200
    finally:
        stop_api(api)


# RequireApiKey: what a request's state carries, and what it is refused with.


async def _through(auth: Authenticator, path: str, key: bytes | None) -> tuple[int, dict[str, object]]:
    """Send one request through ``RequireApiKey`` alone: the status and the state the app saw."""
    seen: dict[str, object] = {}
    sent: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.update(scope["state"])
        sent.append(200)

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            sent.append(message["status"])

    headers = [(b"authorization", b"Bearer " + key)] if key is not None else []
    scope = {"type": "http", "path": path, "headers": headers, "state": {"api": SimpleNamespace(auth=auth)}}
    await RequireApiKey(app)(scope, _no_body, send)
    return sent[0], {name: value for name, value in seen.items() if name != "api"}


async def _no_body() -> Message:
    return {"type": "http.request", "body": b""}


async def test_the_request_state_names_the_tenant_and_its_limits(store: TenantStore) -> None:
    acme = Tenant("acme", limits=TenantLimits(rps=2, concurrency=3))
    await store.add(acme, (key_digest(STORE_KEY),))
    auth = Authenticator(("k1",), store, ttl_s=2, max_entries=100)
    await auth.watch()
    assert await _through(auth, "/v1/completions", STORE_KEY.encode()) == (
        200,
        {"tenant": tenant_of_store(acme), "tenant_name": "acme", "tenant_limits": acme.limits},
    )
    assert await _through(auth, "/tokenize", b"k1") == (
        200,
        {"tenant": tenant_of("k1"), "tenant_name": DEFAULT_TENANT, "tenant_limits": TenantLimits()},
    )
    assert (await _through(auth, "/v1/models", b"sk-nobody-0123456789"))[0] == 401
    assert (await _through(auth, "/v1/models", None))[0] == 401
    assert (await _through(auth, "/health", None))[1]["tenant_name"] == DEFAULT_TENANT  # probes stay open


async def test_without_keys_every_request_is_the_default_tenant_and_a_lost_redis_is_503(store: TenantStore) -> None:
    open_api = Authenticator((), store, ttl_s=2, max_entries=100)
    assert (await _through(open_api, "/v1/models", None))[0] == 503  # the store not read yet: closed
    await open_api.watch()
    assert await _through(open_api, "/v1/models", None) == (
        200,
        {"tenant": NO_TENANT, "tenant_name": DEFAULT_TENANT, "tenant_limits": TenantLimits()},
    )
    await store.add(Tenant("acme"), (key_digest(STORE_KEY),))
    away = Authenticator(("k1",), UnreachableStore(store, answers=0), ttl_s=2, max_entries=100)  # type: ignore[arg-type]
    await away.watch()
    assert (await _through(away, "/v1/models", STORE_KEY.encode()))[0] == 503
    assert (await _through(away, "/v1/models", b"k1"))[0] == 200  # a key given at start needs no Redis


def test_an_api_started_while_redis_is_away_serves_no_one_without_a_key_until_it_answers(
    tmp_path: Path, tiny_model: Path
) -> None:
    """It cannot tell whether the store holds tenants: 503, not open; once Redis answers, the
    tenant it held decides."""
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    url = server.url
    _with_store(url, "away", lambda s: s.add(Tenant("acme"), (key_digest(STORE_KEY),)))
    server.stop()  # its AOF keeps the tenant
    api = start_api(url, "away", [tiny_model])
    try:
        assert _status(api, None) == 503 and _status(api, STORE_KEY) == 503
        assert _status(api, None, "/health") == 200
        server.start()  # same port, password and data folder
        _until(lambda: _status(api, STORE_KEY) == 200, timeout_s=20)
        assert _status(api, None) == 401 and _status(api, "sk-nobody-0123456789") == 401
    finally:
        stop_api(api)
        server.stop()
