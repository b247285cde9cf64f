"""A DP group's plan stream, ``sb:dp:{group}``: the ranks' lock-step barrier (worker/dp.py
decides what a rank posts and when it steps; this module owns the stream and its entries). And
``sb:ep:{group}``, where a group with expert parallelism meets to form its process group
(``ExpertStore``).

Every entry carries the group's ``epoch`` (the ms its ranks formed at) and one of: ``join``
(a rank joined that epoch), ``step`` + ``plan`` (a rank's plan for a step, JSON), ``done`` +
``rank`` (a rank finished a step's forward), ``wake`` (a rank of an idle group has work). The
stream keeps the last ``PLANS_KEPT`` entries (approximately). An entry read is untrusted: one
that is not of these shapes is skipped (logged), and its id still moves the cursor on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from splitbus.bus.core import codec, follow
from splitbus.bus.core.keys import Keys
from splitbus.bus.core.replies import for_xadd

log = logging.getLogger(__name__)
PLANS_KEPT = 2000
MAX_PLAN_BYTES = 1 << 20
"""A plan is a few small fields and the ids of the batches a rank holds: far less than this."""
_MAX_INT_DIGITS = 19
"""Epochs (ms), steps and ranks are non-negative and below 2**63."""

Kind = Literal["join", "plan", "done", "wake"]


@dataclass(frozen=True)
class Post:
    """One entry of the stream. ``rank``: for ``join``, ``done`` and ``wake``; ``step``: for
    ``plan`` and ``done``; ``plan``: the plan's JSON (its rank is inside)."""

    entry_id: str
    epoch: int
    kind: Kind
    rank: int = -1
    step: int = -1
    plan: bytes = b""


class PlanStream:
    """``sb:dp:{group}``: what a rank posts, and the posts it reads."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, group: str) -> None:
        self._redis = redis
        self._key = keys.dp(group)

    async def join(self, epoch: int, rank: int) -> None:
        await self._add({"epoch": epoch, "join": rank})

    def queue_plan(self, pipe: Pipeline, epoch: int, step: int, plan: bytes) -> None:
        """Add the plan to a pipeline the caller sends (a rank's load report goes with it)."""
        entry = codec.flat({"epoch": epoch, "step": step, "plan": plan})
        pipe.xadd(self._key, for_xadd(entry), maxlen=PLANS_KEPT, approximate=True)

    async def done(self, epoch: int, step: int, rank: int) -> None:
        await self._add({"epoch": epoch, "done": step, "rank": rank})

    async def wake(self, epoch: int, rank: int) -> None:
        await self._add({"epoch": epoch, "wake": rank})

    async def _add(self, fields: dict[str, int]) -> None:
        await self._redis.xadd(self._key, for_xadd(codec.flat(fields)), maxlen=PLANS_KEPT, approximate=True)

    async def read(self, after: str, block_s: float) -> tuple[str, list[Post]]:
        """Posts after entry id ``after``, waiting up to ``block_s`` for one (at most 1000);
        returns the id to read after next time, and the readable posts."""
        entries = await follow.read_after(self._redis, {self._key: after}, 1000, max(1, int(block_s * 1000)))
        posts = [post for _, entry_id, fields in entries if (post := _post(entry_id, fields)) is not None]
        return (entries[-1][1] if entries else after), posts


def _post(entry_id: str, fields: Mapping[bytes, bytes]) -> Post | None:
    try:
        return _parse(entry_id, fields)
    except (KeyError, ValueError) as exc:
        log.warning("skipping unreadable DP plan entry %s: %s", entry_id, exc)
        return None


def _parse(entry_id: str, fields: Mapping[bytes, bytes]) -> Post:
    """The post in an entry's fields, tried in this order (as the barrier always read them)."""
    epoch = _int(fields[b"epoch"])
    if b"done" in fields:
        return Post(entry_id, epoch, "done", rank=_int(fields[b"rank"]), step=_int(fields[b"done"]))
    if b"plan" in fields:
        if len(fields[b"plan"]) > MAX_PLAN_BYTES:
            raise ValueError(f"a plan of {len(fields[b'plan'])} bytes")
        return Post(entry_id, epoch, "plan", step=_int(fields[b"step"]), plan=fields[b"plan"])
    if b"join" in fields:
        return Post(entry_id, epoch, "join", rank=_int(fields[b"join"]))
    return Post(entry_id, epoch, "wake", rank=_int(fields[b"wake"]))


def _int(value: bytes) -> int:
    if not value.isdigit() or len(value) > _MAX_INT_DIGITS:
        raise ValueError(f"{value[:24]!r} is not a non-negative integer")
    return int(value)


MAX_HOST_CHARS = 255


@dataclass(frozen=True)
class StoreAddress:
    """Rank 0's store address for one epoch of a group."""

    epoch: int
    host: str
    port: int

    def encode(self) -> bytes:
        return f"{self.epoch} {self.host} {self.port}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> StoreAddress:
        """From Redis (untrusted): ``<epoch> <host> <port>``, each checked; ValueError if not."""
        epoch, host, port = raw.decode().split(" ")
        if not 0 < len(host) <= MAX_HOST_CHARS or not 0 < _int(port.encode()) < 65536:
            raise ValueError(f"a bad store address {raw[:80]!r}")
        return cls(_int(epoch.encode()), host, int(port))


class ExpertStore:
    """``sb:ep:{group}``: rank 0 of a group with expert parallelism writes its store address for
    the group's epoch (``post``); the other ranks read it until it names their epoch (``read``).
    An address of an older epoch is another run's: never used."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, group: str) -> None:
        self._redis = redis
        self._key = keys.ep_store(group)
        self._unreadable = b""
        """The last unreadable value seen (logged once, not at every poll)."""

    async def post(self, address: StoreAddress, ttl_s: int) -> None:
        await self._redis.set(self._key, address.encode(), ex=ttl_s)

    async def read(self, epoch: int) -> StoreAddress | None:
        """The address rank 0 posted for ``epoch``; None while there is none (or only another
        epoch's, or an unreadable value, which is logged)."""
        raw = await self._redis.get(self._key)
        if raw is None:
            return None
        try:
            address = StoreAddress.decode(raw if isinstance(raw, bytes) else raw.encode())
        except (ValueError, UnicodeDecodeError) as exc:
            if raw != self._unreadable:
                log.warning("skipping an unreadable expert store address in %s: %s", self._key, exc)
                self._unreadable = raw if isinstance(raw, bytes) else raw.encode()
            return None
        return address if address.epoch == epoch else None
