"""Tenants' rate and concurrency limits, enforced by every API node together (docs/tenants.md,
"Limits"): ``sb:limits:{cell}:<tenant>``, the tenant's token buckets, and
``sb:inflight:{cell}:<tenant>``, its requests in flight, each with a lease.

Each bucket is a token bucket kept as GCRA does (one number: the time at which the bucket will
be full again, its "theoretical arrival time"), so one admission reads and writes one hash field
per limit, whatever the rate. A bucket holds one second of requests (``rps``, at least one
request) or one minute of tokens (``tpm``, ``prompt_tpm``, ``output_tpm``): a token bucket lets a
tenant that was idle send a burst of that size at once, which a sliding window would too, but in
O(1) memory and one field, where an exact sliding window keeps every request of the window.

Every clock reading is Redis's ``TIME``, inside the script: API nodes' clocks never matter. One
script admits a request (every limit checked, then every bucket charged, or nothing written);
another ends it (its lease dropped, its output tokens charged). Both keys share the cell's tag:
one slot per script run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from splitbus.bus.core.keys import Keys
from splitbus.bus.core.scripts import LuaScript, declare, lua_string
from splitbus.bus.tenants import TenantLimits

BUCKETS = ("req", "tok", "prompt", "output")
"""The bucket hash's fields, in the order the admission script reports them: requests (``rps``),
tokens (``tpm``: prompt and output), prompt tokens (``prompt_tpm``), output tokens (``output_tpm``)."""

_BUCKET_LUA = (
    "local FIELDS = {"
    + ", ".join(map(lua_string, BUCKETS))
    + "}"
    + """
local function bucket(now, tat, per_ms, burst, cost, strict)
  -- GCRA, the bucket is full again at tat; one unit is per_ms of it; it holds burst units.
  local base = math.max(tat or now, now)
  local after = base + cost * per_ms
  local room = burst * per_ms
  local fits = after - now <= room
  if strict then fits = after - now < room end
  if base <= now then fits = true end  -- a full bucket takes any one request, into debt
  local retry = math.max(after - now - room, 1)
  if cost > burst then retry = base - now end
  return fits, after, retry
end
local function report(now, tat, per_ms, burst)
  local used = math.max((tat or now) - now, 0)
  return math.max(math.floor((burst * per_ms - used) / per_ms), 0), math.ceil(used)
end
local function limit(value, unit_ms)
  -- a rate of value units per unit_ms, as ms per unit and the bucket's size (at least one unit)
  if value <= 0 then return nil end
  return {unit_ms / value, math.max(value, 1)}
end
local function full_in(now, tats)
  -- until every bucket is full again, when the hash says nothing a missing one would not
  local latest = now
  for i = 1, 4 do if tats[i] then latest = math.max(latest, tats[i]) end end
  return math.ceil(latest - now) + 1000
end
"""
)

_ADMIT = declare(
    LuaScript(
        name="admit",
        module=__name__,
        keys=("sb:limits:{cell}:<tenant>", "sb:inflight:{cell}:<tenant>"),
        argv="the request's id, its lease (ms), then the tenant's rps, concurrency, tpm, prompt_tpm, output_tpm "
        "(0: none), and the request's prompt tokens",
        returns="{verdict (1 admitted; 0 rps; -1 concurrency; -2 tokens: nothing written), retry after (ms), then per "
        "bucket (requests, tokens, prompt, output) the units left and the ms until it is full (-1, -1: no such limit)}",
        source=f"""{_BUCKET_LUA}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local tats = redis.call('HMGET', KEYS[1], unpack(FIELDS))
for i = 1, 4 do tats[i] = tonumber(tats[i]) end
local prompt = tonumber(ARGV[8])
local specs = {{limit(tonumber(ARGV[3]), 1000), limit(tonumber(ARGV[5]), 60000),
               limit(tonumber(ARGV[6]), 60000), limit(tonumber(ARGV[7]), 60000)}}
local costs = {{1, prompt, prompt, 0}}
local verdict, retry, after = 1, 0, {{}}
for i = 1, 4 do
  local s = specs[i]
  if s then
    local fits, next_tat, wait = bucket(now, tats[i], s[1], s[2], costs[i], i == 4)
    after[i] = next_tat
    if not fits and verdict == 1 then verdict = (i == 1) and 0 or -2 end
    if not fits then retry = math.max(retry, wait) end
  end
end
local concurrency = tonumber(ARGV[4])
if verdict == 1 and concurrency > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= concurrency then verdict, retry = -1, 1000 end
end
if verdict == 1 then
  for i = 1, 4 do
    if after[i] then
      tats[i] = after[i]
      redis.call('HSET', KEYS[1], FIELDS[i], string.format('%.3f', after[i]))
    end
  end
  if next(after) then redis.call('PEXPIRE', KEYS[1], full_in(now, tats)) end
  if concurrency > 0 then
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
    redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]))
  end
end
local out = {{verdict, math.ceil(retry)}}
for i = 1, 4 do
  local s = specs[i]
  if s then
    local left, reset = report(now, tats[i], s[1], s[2])
    out[#out + 1], out[#out + 2] = left, reset
  else
    out[#out + 1], out[#out + 2] = -1, -1
  end
end
return out
""",
    )
)
_END = declare(
    LuaScript(
        name="end_request",
        module=__name__,
        keys=("sb:limits:{cell}:<tenant>", "sb:inflight:{cell}:<tenant>"),
        argv="the request's id, then the tenant's tpm and output_tpm (0: none), and the request's output tokens",
        returns="1 its lease was held (and is dropped); 0 no lease of that id (expired, or none was taken)",
        source=f"""{_BUCKET_LUA}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local output = tonumber(ARGV[4])
local tats = redis.call('HMGET', KEYS[1], unpack(FIELDS))
for i = 1, 4 do tats[i] = tonumber(tats[i]) end
local charged = {{[2] = limit(tonumber(ARGV[2]), 60000), [4] = limit(tonumber(ARGV[3]), 60000)}}
for i, s in pairs(charged) do
  local _, after = bucket(now, tats[i], s[1], s[2], output, false)
  tats[i] = after
  redis.call('HSET', KEYS[1], FIELDS[i], string.format('%.3f', after))
end
if output > 0 and next(charged) then redis.call('PEXPIRE', KEYS[1], full_in(now, tats)) end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then return 1 end
return 0
""",
    )
)


class Verdict(enum.IntEnum):
    """What the ``admit`` script decided."""

    ADMITTED = 1
    """Every limit had room: each bucket is charged and, with ``concurrency``, a lease taken."""
    REQUESTS = 0
    """The requests bucket (``rps``) is empty: nothing written."""
    CONCURRENCY = -1
    """``concurrency`` requests hold leases already: nothing written."""
    TOKENS = -2
    """A tokens bucket (``tpm``, ``prompt_tpm``, ``output_tpm``) has no room: nothing written."""


class Ended(enum.IntEnum):
    """What the ``end_request`` script found."""

    RELEASED = 1
    """The request's lease was held, and is dropped."""
    NO_LEASE = 0
    """No lease of that id: it expired (the request outlived it), or none was taken."""


class BadLimiterReply(ValueError):
    """What the admission script returned is not what it returns: a bug or another program's
    script under its SHA. The caller treats it as a limiter that cannot answer."""


@dataclass(frozen=True)
class Room:
    """One bucket after an admission (or a refusal)."""

    left: int
    """Whole units it holds now (``x-ratelimit-remaining-*``)."""
    full_in_ms: int
    """Until it is full again (``x-ratelimit-reset-*``)."""


@dataclass(frozen=True)
class Admission:
    """The ``admit`` script's answer."""

    verdict: Verdict
    retry_after_ms: int
    """Refused: until the limit that refused has room (concurrency: 1 s, not knowable)."""
    rooms: dict[str, Room]
    """By bucket (``BUCKETS``), those the tenant has a limit for."""

    @classmethod
    def read(cls, reply: object) -> Admission:
        """The script's reply, checked (``BadLimiterReply``)."""
        if not isinstance(reply, list) or len(reply) != 2 + 2 * len(BUCKETS):
            raise BadLimiterReply(f"the admit script returned {str(reply)[:80]!r}")
        try:
            numbers = [int(value) for value in reply]
            verdict = Verdict(numbers[0])
        except (TypeError, ValueError):
            raise BadLimiterReply(f"the admit script returned {str(reply)[:80]!r}") from None
        rooms = {
            name: Room(numbers[2 + 2 * i], numbers[3 + 2 * i])
            for i, name in enumerate(BUCKETS)
            if numbers[2 + 2 * i] >= 0
        }
        return cls(verdict, max(numbers[1], 0), rooms)


def limited(limits: TenantLimits) -> bool:
    """Whether a tenant has any limit the limiter enforces (else its requests never read Redis)."""
    return any(
        value is not None
        for value in (limits.rps, limits.tpm, limits.prompt_tpm, limits.output_tpm, limits.concurrency)
    )


def _rate(value: float | None) -> float:
    return 0 if value is None else value


class Limiter:
    """Admits and ends one cell's tenants' requests, on the bus's client."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._keys = keys
        self._admit = _ADMIT.register(redis)
        self._end = _END.register(redis)

    def _pair(self, tenant: str) -> list[str]:
        return [self._keys.limits(tenant), self._keys.inflight(tenant)]

    async def admit(
        self, tenant: str, request_id: str, limits: TenantLimits, prompt_tokens: int, lease_ms: int
    ) -> Admission:
        """Check every limit of ``limits`` for one request of ``prompt_tokens``, and charge them
        all if each has room (with ``concurrency``: a lease of ``lease_ms`` under ``request_id``)."""
        args: list[str | float] = [request_id, max(int(lease_ms), 1), *self._rates(limits), max(int(prompt_tokens), 0)]
        return Admission.read(await self._admit(keys=self._pair(tenant), args=args))

    async def end(self, tenant: str, request_id: str, limits: TenantLimits, output_tokens: int) -> Ended:
        """The request ended (however): drop its lease and charge its output tokens."""
        args: list[str | float] = [request_id, _rate(limits.tpm), _rate(limits.output_tpm), max(int(output_tokens), 0)]
        return Ended(int(await self._end(keys=self._pair(tenant), args=args)))

    @staticmethod
    def _rates(limits: TenantLimits) -> list[float]:
        """ARGV 3-7: rps, concurrency, tpm, prompt_tpm, output_tpm (0: none)."""
        return [
            _rate(limits.rps),
            _rate(limits.concurrency),
            _rate(limits.tpm),
            _rate(limits.prompt_tpm),
            _rate(limits.output_tpm),
        ]


class ReadsSortedSet(Protocol):
    """A sync client (``splitbus status``'s): what ``in_flight`` needs of it."""

    def zrange(self, name: str, start: str, end: str, *, byscore: bool) -> object: ...


def in_flight(client: ReadsSortedSet, keys: Keys, tenant: str, now_ms: int) -> int:
    """How many of ``tenant``'s requests hold a place (``concurrency``) at ``now_ms`` (Redis's
    clock): its leases not run out. Read-only, for ``splitbus status``; only a tenant with a
    ``concurrency`` limit takes leases (at most that many live ones). ZRANGE, not ZCOUNT: the
    splitbus ACL user may run the one (docs/bus.md), not the other."""
    held = client.zrange(keys.inflight(tenant), f"({now_ms}", "+inf", byscore=True)
    return len(held) if isinstance(held, list) else 0
