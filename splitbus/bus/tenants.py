"""Tenants and their API keys (docs/tenants.md): ``sb:tenants:{cell}``, each tenant's record by
name, and ``sb:tenant-keys:{cell}``, the SHA-256 of each API key -> its tenant's name. A key is
never stored in clear: whoever reads Redis learns which digests exist, not a key that works.

Both keys share the cell's tag, so every script here stays in one slot. A record is JSON and,
like every value read from Redis, untrusted: ``Tenant.from_record`` bounds its size, its fields'
types and values, and refuses a bad one with ``BadTenantRecord`` (that tenant's keys are then
refused; nothing else is affected).
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import orjson
import redis.asyncio as aioredis

from splitbus.bus.core.keys import Keys
from splitbus.bus.core.scripts import LuaScript, declare

MAX_RECORD_BYTES = 1024
"""Longest record read back: an honest one is under 200 bytes."""
MAX_RATE = 1e6
"""Largest requests-per-second limit and weight."""
MAX_TOKENS_PER_MINUTE = 10**12
MAX_CONCURRENCY = 10**6
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
"""A default priority, as a request's ``priority`` (vLLM's field: an int32 here)."""
KEY_CHARS = (16, 256)
"""Shortest and longest API key accepted (a generated one has 46 characters)."""
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ID = re.compile(r"[0-9a-f]{32}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"[\x21-\x7e]+")
"""An API key: visible ASCII, as a Bearer token is sent (no spaces, no control characters)."""


class BadTenantRecord(ValueError):
    """A tenant's record (or a value given for one) that is not a valid tenant: the message says
    which field and why."""


@dataclass(frozen=True)
class TenantLimits:
    """What a tenant may use, and how its requests are ordered. None: no limit. Enforcement is
    the API's (docs/tenants.md, "Limits")."""

    rps: float | None = None
    """Requests per second."""
    tpm: int | None = None
    """Tokens per minute, prompt and output together (what OpenAI's ``x-ratelimit-*-tokens``
    headers count)."""
    prompt_tpm: int | None = None
    """Prompt tokens per minute."""
    output_tpm: int | None = None
    """Output tokens per minute."""
    concurrency: int | None = None
    """Requests in flight at once."""
    priority: int = 0
    """The priority of a request that names none (vLLM's ``priority``: lower is handled earlier)."""
    weight: float = 1.0
    """The tenant's share of prompt tokens among tenants of equal priority (fair share)."""

    def __post_init__(self) -> None:
        _number(self.rps, "rps", float, 0, MAX_RATE, optional=True)
        for name in ("tpm", "prompt_tpm", "output_tpm"):
            _number(getattr(self, name), name, int, 1, MAX_TOKENS_PER_MINUTE, optional=True)
        _number(self.concurrency, "concurrency", int, 1, MAX_CONCURRENCY, optional=True)
        _number(self.priority, "priority", int, *PRIORITY_RANGE)
        _number(self.weight, "weight", float, 0, MAX_RATE)

    def to_json(self) -> dict[str, Any]:
        """The fields that are set (no limit: left out)."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    @classmethod
    def from_json(cls, fields: Mapping[str, Any]) -> TenantLimits:
        """Limits from a record's or a file's fields; an unknown field or a bad value is refused."""
        unknown = set(fields) - LIMIT_FIELDS
        if unknown:
            raise BadTenantRecord(f"unknown tenant field(s): {', '.join(sorted(repr(str(f)[:64]) for f in unknown))}")
        try:
            return cls(**fields)
        except TypeError as exc:  # not reached with known names; kept as the record's own error
            raise BadTenantRecord(str(exc)) from None


LIMIT_FIELDS = frozenset(TenantLimits.__dataclass_fields__)


def _number(value: object, name: str, kind: type, low: float, high: float, optional: bool = False) -> None:
    """``value`` is a ``kind`` (an int is a float too; a bool is neither) in ``[low, high]``, or
    above ``low`` for a float (a rate or a weight of 0 is no rate); None where ``optional``."""
    if value is None and optional:
        return
    if not _is_a(value, kind):
        raise BadTenantRecord(f"{name} must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    assert isinstance(value, int | float)
    if not _within(value, low, high, open_low=kind is float):
        raise BadTenantRecord(f"{name} must be in {'(' if kind is float else '['}{low}, {high}], got {value!r}")


def _is_a(value: object, kind: type) -> bool:
    """An int, or for ``float`` an int or a float; never a bool (JSON's ``true`` is no number)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int | float) if kind is float else isinstance(value, int)


def _within(value: float, low: float, high: float, open_low: bool) -> bool:
    above = value > low if open_low else value >= low
    return above and value <= high and math.isfinite(value)


@dataclass(frozen=True)
class Tenant:
    """A tenant: a name, an id of its own, and its limits."""

    name: str
    """What the operator calls it (``splitbus tenants add NAME``): letters, digits, ``_.-``, at
    most 64."""
    id: str = field(default_factory=lambda: secrets.token_hex(16))
    """32 hex digits drawn when the tenant is added: what its requests' prefix-cache salt is made
    of (``splitbus.api.tenants``), so that a tenant added again under a removed one's name does
    not share its cache."""
    limits: TenantLimits = TenantLimits()

    def __post_init__(self) -> None:
        check_name(self.name)
        if not isinstance(self.id, str) or not _ID.fullmatch(self.id):
            raise BadTenantRecord(f"tenant {self.name}: id must be 32 hex digits, got {str(self.id)[:40]!r}")

    def record(self) -> bytes:
        """The record stored under the tenant's name."""
        return orjson.dumps({"id": self.id, **self.limits.to_json()})

    @classmethod
    def from_record(cls, name: str, raw: object) -> Tenant:
        """The tenant a stored record describes; ``BadTenantRecord`` for anything else."""
        if not isinstance(raw, bytes | str) or len(raw) > MAX_RECORD_BYTES:
            raise BadTenantRecord(f"tenant {name[:64]!r}: the record is not text of at most {MAX_RECORD_BYTES} bytes")
        try:
            fields = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise BadTenantRecord(f"tenant {name[:64]!r}: the record is not JSON") from None
        if not isinstance(fields, dict):
            raise BadTenantRecord(f"tenant {name[:64]!r}: the record is not a JSON object")
        tenant_id = fields.pop("id", None)
        try:
            return cls(name, tenant_id, TenantLimits.from_json(fields))
        except BadTenantRecord as exc:
            raise BadTenantRecord(f"tenant {name[:64]!r}: {exc}") from None


RESERVED_NAME = "default"
"""The tenant of the keys an API is started with (and of no key): no stored tenant may take its
name, which would share its fair share, its weight and its metrics with theirs."""


def check_name(name: object) -> str:
    """A tenant's name, checked: it is a hash field, a metrics label and a column of a table."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadTenantRecord(f"a tenant's name is 1 to 64 letters, digits, '_', '.' or '-', got {str(name)[:80]!r}")
    if name == RESERVED_NAME:
        raise BadTenantRecord(f"{RESERVED_NAME!r} names the keys an API is started with; choose another name")
    return name


def check_key(key: str) -> str:
    """An API key, checked: visible ASCII (as a Bearer token is sent), 16 to 256 characters."""
    if not KEY_CHARS[0] <= len(key) <= KEY_CHARS[1] or not _KEY.fullmatch(key):
        raise BadTenantRecord(
            f"an API key is {KEY_CHARS[0]} to {KEY_CHARS[1]} visible ASCII characters (no spaces), "
            f"got one of {len(key)} characters"
        )
    return key


def new_key() -> str:
    """A fresh API key: 256 random bits (``sb-`` and 43 URL-safe characters)."""
    return "sb-" + secrets.token_urlsafe(32)


def key_digest(key: str | bytes) -> str:
    """What the store keeps of an API key: its SHA-256, in hex (``sha256sum`` gives the same).
    Unsalted, so that any API node finds a key's tenant with one read: a generated key has 256
    random bits, and a key given with ``--key`` at least 16 characters, so a digest leaks none."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def check_digest(digest: str) -> str:
    """A key's digest as a file may give it: 64 lower-case hex digits."""
    if not _DIGEST.fullmatch(digest):
        raise BadTenantRecord(f"a key's SHA-256 is 64 lower-case hex digits, got {digest[:80]!r}")
    return digest


class AddOutcome(enum.IntEnum):
    """What the ``add_tenant`` and ``add_tenant_keys`` scripts did."""

    ADDED = 1
    """Written: the tenant (``add_tenant``) or its keys (``add_tenant_keys``; a key that was the
    tenant's already counts as added)."""
    EXISTS = 0
    """``add_tenant``: a tenant of that name exists; ``add_tenant_keys``: no tenant of that name.
    Nothing written."""
    KEY_TAKEN = -1
    """A key is another tenant's (``add_tenant``: any tenant's). Nothing written."""


class SetOutcome(enum.IntEnum):
    """What the ``set_tenant`` script did."""

    SET = 1
    """The record was the one read, and is replaced."""
    MISSING = 0
    """No tenant of that name: nothing written."""
    CHANGED = -1
    """The record changed since it was read (another operator's ``set``): nothing written."""


_ADD = declare(
    LuaScript(
        name="add_tenant",
        module=__name__,
        keys=("sb:tenants:{cell}", "sb:tenant-keys:{cell}"),
        argv="the tenant's name, its record (JSON), then the SHA-256 (hex) of each of its API keys",
        returns="1 added; 0 a tenant of that name exists (nothing written); -1 a key is a tenant's already "
        "(nothing written)",
        source="""
if redis.call('HGET', KEYS[1], ARGV[1]) then return 0 end
for i = 3, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[i]) then return -1 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
for i = 3, #ARGV do redis.call('HSET', KEYS[2], ARGV[i], ARGV[1]) end
return 1
""",
    )
)
_ADD_KEYS = declare(
    LuaScript(
        name="add_tenant_keys",
        module=__name__,
        keys=("sb:tenants:{cell}", "sb:tenant-keys:{cell}"),
        argv="the tenant's name, then the SHA-256 (hex) of each API key to add",
        returns="1 added (or the tenant's already); 0 no tenant of that name (nothing written); -1 a key is "
        "another tenant's (nothing written)",
        source="""
if not redis.call('HGET', KEYS[1], ARGV[1]) then return 0 end
for i = 2, #ARGV do
  local owner = redis.call('HGET', KEYS[2], ARGV[i])
  if owner and owner ~= ARGV[1] then return -1 end
end
for i = 2, #ARGV do redis.call('HSET', KEYS[2], ARGV[i], ARGV[1]) end
return 1
""",
    )
)
_SET = declare(
    LuaScript(
        name="set_tenant",
        module=__name__,
        keys=("sb:tenants:{cell}",),
        argv="the tenant's name, its record as read, its new record",
        returns="1 set; 0 no tenant of that name (nothing written); -1 the record changed since it was read "
        "(nothing written)",
        source="""
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return 0 end
if old ~= ARGV[2] then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
""",
    )
)
_REMOVE = declare(
    LuaScript(
        name="remove_tenant",
        module=__name__,
        keys=("sb:tenants:{cell}", "sb:tenant-keys:{cell}"),
        argv="the tenant's name",
        returns="how many API keys were removed with the tenant; -1 no tenant of that name (its keys, if any, "
        "are removed all the same)",
        source="""
local found = redis.call('HDEL', KEYS[1], ARGV[1])
local all = redis.call('HGETALL', KEYS[2])
local removed = 0
for i = 1, #all, 2 do
  if all[i + 1] == ARGV[1] then
    redis.call('HDEL', KEYS[2], all[i])
    removed = removed + 1
  end
end
if found == 0 then return -1 end
return removed
""",
    )
)
_BY_KEY = declare(
    LuaScript(
        name="tenant_by_key",
        module=__name__,
        keys=("sb:tenant-keys:{cell}", "sb:tenants:{cell}"),
        argv="the SHA-256 (hex) of an API key",
        returns="{name, record} of the key's tenant (record nil: the tenant is gone); nil: no such key",
        source="""
local name = redis.call('HGET', KEYS[1], ARGV[1])
if not name then return nil end
return {name, redis.call('HGET', KEYS[2], name)}
""",
    )
)


class TenantError(Exception):
    """A tenant operation that cannot be done as asked (no such tenant, a name or key taken):
    the message says what, for an operator."""


class TenantStore:
    """The tenants of one cell and their keys' digests, on the bus's client."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._keys = (keys.tenants, keys.tenant_keys)
        self._add = _ADD.register(redis)
        self._add_keys = _ADD_KEYS.register(redis)
        self._set = _SET.register(redis)
        self._remove = _REMOVE.register(redis)
        self._by_key = _BY_KEY.register(redis)
        self._redis = redis

    async def add(self, tenant: Tenant, digests: tuple[str, ...] = ()) -> None:
        """Add a tenant with the keys whose digests are given; ``TenantError`` if its name or a
        key is taken (then nothing is written)."""
        outcome = AddOutcome(int(await self._add(keys=list(self._keys), args=[tenant.name, tenant.record(), *digests])))
        if outcome is AddOutcome.EXISTS:
            raise TenantError(f"a tenant named {tenant.name} exists")
        if outcome is AddOutcome.KEY_TAKEN:
            raise TenantError("that API key is a tenant's already")

    async def add_keys(self, name: str, digests: tuple[str, ...]) -> None:
        """Give an existing tenant more keys; ``TenantError`` if there is no such tenant or a key
        is another's."""
        outcome = AddOutcome(int(await self._add_keys(keys=list(self._keys), args=[name, *digests])))
        if outcome is AddOutcome.EXISTS:
            raise TenantError(f"no tenant named {name}")
        if outcome is AddOutcome.KEY_TAKEN:
            raise TenantError("that API key is another tenant's")

    async def set(self, name: str, **changes: Any) -> Tenant:
        """Change some of a tenant's limits (``TenantLimits``' fields; None: no limit) and return
        it as now stored. A record changed by someone else meanwhile is read again."""
        while True:
            raw = await self._redis.hget(self._keys[0], name)
            if raw is None:
                raise TenantError(f"no tenant named {name}")
            old = Tenant.from_record(name, raw)
            new = replace(old, limits=replace(old.limits, **changes))
            outcome = SetOutcome(int(await self._set(keys=[self._keys[0]], args=[name, raw, new.record()])))
            if outcome is SetOutcome.SET:
                return new
            if outcome is SetOutcome.MISSING:
                raise TenantError(f"no tenant named {name}")

    async def remove(self, name: str) -> int:
        """Remove a tenant and every key of its; how many keys went. ``TenantError`` if there was
        no such tenant."""
        removed = int(await self._remove(keys=list(self._keys), args=[name]))
        if removed < 0:
            raise TenantError(f"no tenant named {name}")
        return removed

    async def get(self, name: str) -> Tenant | None:
        """The tenant of that name, None if there is none; ``BadTenantRecord`` for a bad record."""
        raw = await self._redis.hget(self._keys[0], name)
        return None if raw is None else Tenant.from_record(name, raw)

    async def all(self) -> list[Tenant | BadTenantRecord]:
        """Every tenant, by name; a bad record as its error, so that one does not hide the others."""
        records = await self._redis.hgetall(self._keys[0])
        return [_read(_text(name), raw) for name, raw in sorted(records.items())]

    async def key_counts(self) -> dict[str, int]:
        """How many keys each tenant has (by name), for ``tenants list``."""
        counts: dict[str, int] = {}
        for name in (await self._redis.hgetall(self._keys[1])).values():
            counts[_text(name)] = counts.get(_text(name), 0) + 1
        return counts

    async def by_key(self, key: bytes) -> Tenant | None:
        """The tenant of an API key; None for a key that is no tenant's (or whose tenant is gone);
        ``BadTenantRecord`` for a bad record."""
        return await self.by_digest(key_digest(key))

    async def by_digest(self, digest: str) -> Tenant | None:
        """``by_key`` for a key's digest (``key_digest``)."""
        found = await self._by_key(keys=list(reversed(self._keys)), args=[digest])
        if not isinstance(found, list) or len(found) != 2 or found[1] is None:
            return None
        return Tenant.from_record(_text(found[0]), found[1])

    async def any(self) -> bool:
        """Whether the cell has a tenant: then every API node requires a key."""
        return bool(await self._redis.exists(self._keys[0]))


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _read(name: str, raw: object) -> Tenant | BadTenantRecord:
    try:
        return Tenant.from_record(name, raw)
    except BadTenantRecord as exc:
        return exc


class ReadsHash(Protocol):
    """A sync client (``splitbus status``'s): what ``stored_tenants`` needs of it."""

    def hgetall(self, name: str) -> object: ...


def stored_tenants(client: ReadsHash, keys: Keys) -> list[Tenant | BadTenantRecord]:
    """``TenantStore.all`` on a sync client, for ``splitbus status``: every tenant, by name; a bad
    record as its error."""
    records = client.hgetall(keys.tenants)
    if not isinstance(records, dict):
        return []
    return [_read(_text(name), raw) for name, raw in sorted(records.items())]
