"""Who a request comes from: its API key's tenant, with the tenant's limits, and whose cached
prompts it may reuse (docs/tenants.md; docs/security.md, "The prefix cache is shared only within
a tenant").

A key is looked up among the keys the API was started with (``--api-key``, ``SPLITBUS_API_KEYS``:
the ``default`` tenant, without limits), then in the tenant store (``splitbus.bus.tenants``), whose
answers (a tenant, or no tenant) an ``Authenticator`` keeps ``tenant_cache_s`` in a bounded cache:
a request does not read Redis, a key once a few seconds per API node does. While Redis cannot be
read, the last answer for a key stands; a key never answered is refused with 503.

A request's hash chain is salted (``GenerateRequest.cache_salt``) with a digest of its tenant's
cache identity and of the body's optional ``cache_salt`` (vLLM's field), so a request reuses only
the KV of requests with the same identity and the same ``cache_salt``: another tenant's prompt
can no longer show through ``cached_tokens`` or the time to the first token. The identity is a
digest of the key for a key the API was started with (each such key apart, as before tenants), and
of the tenant's ``id`` for a tenant in the store (its keys share a cache; a tenant added again
under a removed one's name gets a new id, so not its cache). The key never reaches the bus.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from splitbus.bus.blocks import HEX_DIGITS
from splitbus.bus.core.connection import TRANSIENT_ERRORS
from splitbus.bus.tenants import (
    KEY_CHARS,
    RESERVED_NAME,
    BadTenantRecord,
    Tenant,
    TenantLimits,
    TenantStore,
    key_digest,
)

log = logging.getLogger(__name__)

NO_TENANT = b""
"""The cache identity of every request when no API key is required."""
DEFAULT_TENANT = RESERVED_NAME
"""The tenant of the keys the API was started with, and of every request when none is required."""
_DIGEST = HEX_DIGITS // 2
UNREADABLE: tuple[type[BaseException], ...] = (RedisError, *TRANSIENT_ERRORS)
"""What a store read that Redis could not answer raises."""


def tenant_of(api_key: str) -> bytes:
    """The cache identity of a key the API was started with: a digest of it (what the API keeps
    of it per request, and salts with), not the key."""
    return hashlib.blake2b(api_key.encode(), digest_size=_DIGEST, person=b"sb-tenant").digest()


def tenant_of_store(tenant: Tenant) -> bytes:
    """The cache identity of a tenant in the store: a digest of its ``id`` (personalized apart
    from ``tenant_of``'s, so that no key's identity is a tenant's)."""
    return hashlib.blake2b(tenant.id.encode(), digest_size=_DIGEST, person=b"sb-tenant-id").digest()


def cache_salt(tenant: bytes, salt: str | None) -> str:
    """The salt of a request's hash chain (``GenerateRequest.cache_salt``): "" (unsalted, as before
    tenants) for no tenant and no ``salt``, else ``HEX_DIGITS`` hex digits of a digest of both.
    The tenant's digest is of a fixed length (or empty, with its length first), so no choice of
    ``salt`` by one tenant reproduces another's input."""
    if tenant == NO_TENANT and salt is None:
        return ""
    h = hashlib.blake2b(digest_size=_DIGEST, person=b"sb-cache-salt")
    h.update(bytes([len(tenant)]) + tenant)
    h.update(b"\x00" if salt is None else b"\x01" + salt.encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Caller:
    """What a request's key names (``request.state.tenant_name``, ``tenant_limits``, ``tenant``)."""

    name: str
    """The tenant's name (``DEFAULT_TENANT`` for a key the API was started with, or no key)."""
    limits: TenantLimits
    """Its limits, priority and weight."""
    cache: bytes
    """Its cache identity (``cache_salt``'s first argument)."""


ANONYMOUS = Caller(DEFAULT_TENANT, TenantLimits(), NO_TENANT)
"""Every request while no key is required."""


class LookupFailed(Exception):
    """Redis could not be read for a key never answered before: the request gets 503."""


class Authenticator:
    """Finds a key's tenant (``caller``), and whether keys are required at all (``required``):
    when the API was started with keys, or once the store has held a tenant (then until the
    process ends: removing the last tenant does not open a running API), or while the store has
    not been read yet (Redis unreachable since the start: closed, not open, until it answers)."""

    def __init__(
        self,
        static_keys: tuple[str, ...],
        store: TenantStore,
        ttl_s: float,
        max_entries: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._static = {key_digest(key): Caller(DEFAULT_TENANT, TenantLimits(), tenant_of(key)) for key in static_keys}
        self._store = store
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        self._cache: OrderedDict[str, tuple[float, Caller | None]] = OrderedDict()
        self._store_used: bool | None = None
        """Whether the store has held a tenant; None: not read yet."""

    @property
    def required(self) -> bool:
        return bool(self._static) or self._store_used is not False

    async def watch(self) -> None:
        """Whether the store holds a tenant (called at start, then every ``ttl_s``): the first
        one turns keys on."""
        if self._store_used:
            return
        self._store_used = await self._store.any()
        if self._store_used:
            log.info("the tenant store holds tenants: API keys are required from now on")

    async def caller(self, token: bytes) -> Caller | None:
        """The tenant of a Bearer token; None for a key that is no tenant's. ``LookupFailed``
        when Redis cannot say, and never said."""
        digest = key_digest(token)
        static = self._static.get(digest)
        if static is None and self._store_used is None:
            raise LookupFailed("the tenant store has not been read since the start")
        if static is not None or not KEY_CHARS[0] <= len(token) <= KEY_CHARS[1]:
            return static  # a token no store key can be is looked up nowhere
        return await self._cached(digest)

    async def _cached(self, digest: str) -> Caller | None:
        now = self._clock()
        entry = self._cache.get(digest)
        if entry is not None and now - entry[0] < self._ttl_s:
            self._cache.move_to_end(digest)
            return entry[1]
        try:
            found = await self._fetch(digest)
        except UNREADABLE as exc:
            if entry is None:
                raise LookupFailed(str(exc)) from exc
            return entry[1]  # Redis is away: what it said last stands
        self._remember(digest, now, found)
        return found

    async def _fetch(self, digest: str) -> Caller | None:
        try:
            tenant = await self._store.by_digest(digest)
        except BadTenantRecord as exc:  # that tenant's keys are refused; said once per key per ttl_s
            log.warning("an API key is refused: its tenant's record is invalid: %s", exc)
            return None
        return None if tenant is None else Caller(tenant.name, tenant.limits, tenant_of_store(tenant))

    def _remember(self, digest: str, now: float, found: Caller | None) -> None:
        """Keep the answer, the oldest going past ``max_entries`` (a client that sends many
        unknown keys cannot grow the cache)."""
        self._cache[digest] = (now, found)
        self._cache.move_to_end(digest)
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)
