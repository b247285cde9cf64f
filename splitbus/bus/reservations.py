"""A request's KV reservation, ``sb:kv:{cell}:<request>``: written by the decode worker that reserved
blocks for it, read by the prefill worker that sends it the KV and by a reaper that frees the
decode side of a dead prefill worker's request (docs/protocol.md). This module is the only one
that names the key or runs its scripts.

A reservation is made for one dispatch of the request (its tasks' hand-off id) and only while
that dispatch is the request's current one (``sb:current:{cell}:<request>``): a decode task that the
reaper already replaced (its prefill worker died, and the request went to a new pair) reserves
nothing, so it cannot hold blocks, or a prefill worker, for a dispatch that no longer exists.
Both keys carry the request's hash tag.

Anyone who can write to Redis can write the hash, so what is read from it is validated
(``Reservation``): types and sizes; whether it is the reservation a reader may use is the
reader's check (``Reservation.made_for``, and P's comparison of the endpoint with D's
registry record).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from splitbus.bus.core.cluster import as_cluster
from splitbus.bus.core.keys import Keys
from splitbus.bus.core.scripts import LuaScript, declare
from splitbus.bus.messages._check import MAX_KV_BLOCKS, MAX_NAME_CHARS, require_int, require_str

log = logging.getLogger(__name__)

TTL_S = 300
"""A reservation outlives any hand-off (the kv wait is far shorter); D deletes it when done."""
MAX_HANDOFF_CHARS = 64
"""A task's hand-off id is at most this long (messages/tasks.py)."""
MAX_SECRET_CHARS = 256
"""Secrets are 64 hex characters (``transfer.new_secret``); anything much longer is not one."""
_MAX_FIELD_BYTES = 4 * max(MAX_NAME_CHARS, MAX_SECRET_CHARS)
"""Longer than any valid field in UTF-8: a longer value is refused before it is decoded."""

_RESERVE = declare(
    LuaScript(
        name="reserve_kv",
        module=__name__,
        keys=("sb:kv:{cell}:<request>", "sb:current:{cell}:<request>"),
        argv='the task\'s hand-off id ("" for none), the TTL (s), then field, value pairs',
        returns="1: written (HSET, EXPIRE); 0: the request's current dispatch is another, nothing written",
        source="""
local current = redis.call('GET', KEYS[2])
if ARGV[1] ~= '' and current and current ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
""",
    )
)

_DROP = declare(
    LuaScript(
        name="drop_kv",
        module=__name__,
        keys=("sb:kv:{cell}:<request>",),
        argv="the task entry id that made the reservation",
        returns="1: deleted; 0: the reservation is another task's (or gone), left alone",
        source="""
if redis.call('HGET', KEYS[1], 'task_entry') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""",
    )
)


@dataclass(frozen=True)
class Reservation:
    """What a decode worker writes in ``sb:kv:{cell}:<request>`` once it holds the request's blocks."""

    decode_worker: str
    """The decode worker that reserved (and waits for the KV)."""
    endpoint: str
    """The decode worker's transfer endpoint; P sends only if it is D's registered one."""
    blocks: int
    """KV blocks reserved."""
    prefill_worker: str
    """The prefill worker its task names: the only sender it takes the KV from."""
    task_entry: str
    """The decode task's entry id: a clean-up drops only the reservation its own task made."""
    secret: str = dataclasses.field(repr=False)
    """Random per reservation; P proves it in the KV frame. Never logged."""
    handoff: str = ""
    """The dispatch the reservation was made for ("" from a decode worker before hand-off ids)."""

    def __post_init__(self) -> None:
        for name in ("decode_worker", "prefill_worker", "task_entry"):
            require_str(getattr(self, name), name)
        require_str(self.endpoint, "endpoint", nonempty=False)
        require_str(self.secret, "secret", nonempty=False, max_chars=MAX_SECRET_CHARS)
        require_str(self.handoff, "handoff", nonempty=False, max_chars=MAX_HANDOFF_CHARS)
        require_int(self.blocks, "blocks", 0, MAX_KV_BLOCKS)

    def made_for(self, decode_worker: str, prefill_worker: str, handoff: str) -> bool:
        """Whether this is the reservation of that pair's dispatch ``handoff`` (not an older
        dispatch's, nor one another worker made)."""
        return (self.decode_worker, self.prefill_worker, self.handoff) == (decode_worker, prefill_worker, handoff)

    def to_hash(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_reply(cls, values: Sequence[bytes | None]) -> Reservation:
        """From ``HMGET`` of ``FIELDS``; raises ValueError for a missing or malformed field (an
        absent ``handoff`` is "": decode workers before hand-off ids write none)."""
        raw = dict(zip(FIELDS, values, strict=True))
        if raw["handoff"] is None:
            raw["handoff"] = b""
        missing = [name for name, value in raw.items() if value is None]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        text = {name: _text(value, name) for name, value in raw.items() if value is not None}
        blocks = text.pop("blocks")
        if not blocks.isdigit() or len(blocks) > 10:
            raise ValueError(f"blocks must be a small non-negative integer, got {blocks[:20]!r}")
        return cls(blocks=int(blocks), **text)


FIELDS = tuple(f.name for f in dataclasses.fields(Reservation))
"""The hash's fields (HMGET reads only these: a hash stuffed with others costs a reader nothing)."""


def _text(value: bytes, name: str) -> str:
    if len(value) > _MAX_FIELD_BYTES:  # before decoding: a forged hash may hold megabytes
        raise ValueError(f"{name} is {len(value)} bytes")
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise ValueError(f"{name} is not UTF-8") from None


class Reservations:
    """The ``sb:kv`` protocol: reserve, read, drop."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.keys = keys
        self._redis = redis
        self._reserve = _RESERVE.register(redis)
        self._drop = _DROP.register(redis)

    async def reserve(self, request_id: str, reservation: Reservation) -> bool:
        """Write the reservation for its dispatch (``reservation.handoff``); False (nothing
        written) if the request's current dispatch is another. Handoff "" (a task from before
        hand-off ids), or no current id (it outlived its TTL): nothing to compare, written."""
        pairs = [item for pair in reservation.to_hash().items() for item in pair]
        keys = [self.keys.kv(request_id), self.keys.current(request_id)]
        return bool(await self._reserve(keys=keys, args=[reservation.handoff, TTL_S, *pairs]))

    async def read(self, request_id: str) -> Reservation | None:
        """The request's reservation; None if there is none, or it is not a valid one."""
        reply = await self._redis.hmget(self.keys.kv(request_id), FIELDS)
        return self.parse(request_id, cast(list[bytes | None], reply))

    def queue_read(self, pipe: Pipeline, request_id: str) -> None:
        """Add the read to a pipeline that goes out anyway (P's poll reads D's record with it);
        its reply is for ``parse``."""
        pipe.hmget(self.keys.kv(request_id), FIELDS)

    @staticmethod
    def parse(request_id: str, reply: Sequence[bytes | None]) -> Reservation | None:
        """The reservation in a ``queue_read`` reply; None if there is none or it is invalid
        (logged at debug level: P polls a forged one until its kv wait ends)."""
        if all(value is None for value in reply):
            return None
        try:
            return Reservation.from_reply(reply)
        except ValueError as exc:
            log.debug("ignoring the invalid KV reservation of %s: %s", request_id, exc)
            return None

    async def drop(self, request_id: str, task_entry: str, client: aioredis.Redis | None = None) -> None:
        """Delete the reservation only if it is still the one the task ``task_entry`` made: the
        request may have moved here again, and its new task's reservation must stay. ``client``:
        a pipeline to queue it in; on a cluster it runs at once instead (a cluster pipeline does not
        load a script where it is missing; the script call here does)."""
        if as_cluster(self._redis) is not None:
            client = None
        await self._drop(keys=[self.keys.kv(request_id)], args=[task_entry], client=client)
