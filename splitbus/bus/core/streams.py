"""Stream primitives: produce, consume in a group with capacity gating, ack, claim, dead-letter,
trim."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from splitbus.bus.core import cluster, codec, hopmarks, metrics
from splitbus.bus.core.batching import Batcher
from splitbus.bus.core.codec import Message
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import is_transient
from splitbus.bus.core.dead import DeadLetter
from splitbus.bus.core.errors import DecodeError
from splitbus.bus.core.replies import (
    EntryFields,
    MaybeEntry,
    ScriptEntries,
    XInfoConsumer,
    XInfoGroup,
    XPendingRow,
    XPendingSummary,
    XReadGroupReply,
    autoclaim_parts,
    for_xadd,
    pairs,
    text,
)
from splitbus.bus.core.scripts import LuaScript, declare

log = logging.getLogger(__name__)


_Read = tuple[str, EntryFields | None]
"""An entry read or claimed, its id decoded."""


_GROUP_STREAM = "sb:requests:{cell} | sb:tasks:{cell}:<worker> | sb:ctrl:{cell}:<worker>"
"""A stream read in a consumer group."""

# Claims every entry pending with one consumer (ARGV[2]) for another (ARGV[3]), in one step on
# one key: an entry another claimer took first is no longer the owner's, so it is not taken twice.
_CLAIM_FROM = declare(
    LuaScript(
        name="claim_from",
        module=__name__,
        keys=(_GROUP_STREAM,),
        argv="the group, the owner (a consumer known to be gone), the claiming consumer, the most entries to take",
        returns="the claimed entries, as `XCLAIM` returns them (an entry trimmed while pending has no fields)",
        source="""
local ids = {}
for _, row in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', ARGV[4], ARGV[2])) do
  ids[#ids + 1] = row[1]
end
if #ids == 0 then return {} end
return redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, unpack(ids))
""",
    )
)

# Deletes a consumer only if nothing is pending with it: it may have read again since it was
# looked at, and XGROUP DELCONSUMER drops its pending entries.
_FORGET = declare(
    LuaScript(
        name="forget_consumer",
        module=__name__,
        keys=(_GROUP_STREAM,),
        argv="the group, the consumer",
        returns="1: deleted; 0: something is pending with it, kept",
        source="""
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
""",
    )
)


@dataclass(frozen=True)
class ConsumerInfo:
    """One consumer of a group, from ``XINFO CONSUMERS``."""

    name: str
    pending: int
    idle_ms: int
    """Since its last read or claim."""


T = TypeVar("T", covariant=True)
"""A delivery's message type (covariant: a ``Delivery[Task]`` is a ``Delivery[Message]``)."""


@dataclass(frozen=True)
class Delivery(Generic[T]):
    """One decoded entry handed to a consumer; ack it with its ``entry_id``. A consumer gets
    ``Delivery[Message]``: any registered message, whatever the stream should carry, so its
    handler checks the type (``isinstance``) before it uses one."""

    stream: str
    entry_id: str
    message: T
    published_us: int | None = None
    """When the entry was written (publisher's clock, µs since the epoch)."""


class Producer:
    """Writes messages to streams: one XADD, or many in one pipeline. With ``batched``, the
    XADDs of concurrent ``send`` calls share pipelines (see ``Batcher``)."""

    def __init__(self, redis: aioredis.Redis, config: BusConfig, batched: bool = False) -> None:
        self._redis = redis
        self._keys = config.keys
        self._batcher = Batcher(redis) if batched else None

    async def send(self, stream: str, msg: Message, maxlen: int | None = None) -> str:
        fields = for_xadd(codec.encode(msg))
        if self._batcher is not None:
            entry_id = await self._batcher.run("xadd", stream, fields, maxlen=maxlen, approximate=True)
        else:
            entry_id = await self._redis.xadd(stream, fields, maxlen=maxlen, approximate=True)
        metrics.ENTRIES_PRODUCED.labels(self._keys.kind(stream)).inc()
        return text(entry_id)

    async def send_many(self, items: Sequence[tuple[str, Message]]) -> list[str]:
        """XADD each (stream, message) in one pipeline (no MULTI: entries go to many slots)."""
        if not items:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for stream, msg in items:
            pipe.xadd(stream, for_xadd(codec.encode(msg)))
        ids = await pipe.execute()
        for stream, _ in items:
            metrics.ENTRIES_PRODUCED.labels(self._keys.kind(stream)).inc()
        return [text(i) for i in ids]


class DeadLetters:
    """Moves entries out of circulation into ``sb:dead:{cell}``, then acks them where they were."""

    def __init__(self, redis: aioredis.Redis, config: BusConfig) -> None:
        self._redis = redis
        self._config = config
        self._keys = config.keys

    async def send(
        self, stream: str, group: str, entry_id: str, fields: Mapping[bytes, bytes], reason: str, deliveries: int
    ) -> None:
        original_type, original_data = codec.as_text(fields)
        letter = DeadLetter(stream, entry_id, reason, deliveries, group, original_type, original_data)
        # Two keys in different cluster slots, so no MULTI: a crash between the two leaves the
        # entry pending and it is dead-lettered again later (a duplicate letter, never a loss).
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(self._keys.dead, for_xadd(codec.encode(letter)), maxlen=self._config.dead_maxlen, approximate=True)
        pipe.xack(stream, group, entry_id)
        await pipe.execute()
        label = reason.split(":", 1)[0] if reason.split(":", 1)[0] in metrics.DEAD_LETTER_REASONS else "handler_failed"
        metrics.ENTRIES_DEAD_LETTERED.labels(self._keys.kind(stream), label).inc()
        log.warning("dead-lettered %s %s (%s, %d deliveries)", stream, entry_id, reason, deliveries)


class GroupConsumer:
    """One consumer in a consumer group on one stream.

    ``read(capacity)`` returns at most ``capacity`` entries and reads nothing when it is 0, so a
    worker never takes work it cannot start. On its first reads it re-delivers its own pending
    entries (left by a previous run under the same consumer name) before new ones; each such
    re-read counts as a delivery (Redis increments the count on a history read too), and an
    entry past ``max_deliveries`` is dead-lettered instead of handed out, so an entry that kills
    its consumer every time ends in ``sb:dead:{cell}`` rather than in a crash loop.

    Entries this consumer dead-letters itself (undecodable, past the delivery bound) are passed
    to ``on_dead(named, reason)`` when they name a request, so its client can be told.
    A dead letter Redis refuses (OOM, outage) is kept and sent again before the next read.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        config: BusConfig,
        stream: str,
        group: str,
        consumer: str,
        on_dead: Callable[[codec.NamedRequest, str], None] | None = None,
    ) -> None:
        self._redis = redis
        self._config = config
        self.stream, self.group, self.consumer = stream, group, consumer
        self._dead = DeadLetters(redis, config)
        self._on_dead = on_dead
        self._kind = config.keys.kind(stream)
        self._pending_cursor: str | None = "0"  # None once our own backlog is drained
        self._claim_cursor = "0-0"
        self._graves: list[tuple[str, Mapping[bytes, bytes], str, int]] = []
        """Dead letters Redis refused: (entry id, fields, reason, deliveries), sent again first."""

    async def ensure_group(self, start_id: str = "0") -> None:
        """Create the group (and the stream). An existing group is fine (BUSYGROUP)."""
        try:
            await self._redis.xgroup_create(self.stream, self.group, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, capacity: int, block_ms: int | None = None) -> list[Delivery[Message]]:
        """Up to ``capacity`` entries; blocks up to ``block_ms`` for new ones (0: not at all).

        Redis ends a blocked read's timeout only when its event loop next wakes, which on an
        idle server can be 1000/hz ms (100 ms with the default hz 10) late: a short precise
        wait is a non-blocking read and a sleep here (``read_within``), not a short BLOCK."""
        if capacity <= 0:
            return []
        await self.send_graves()
        if self._pending_cursor is None:
            block = self._config.block_ms if block_ms is None else block_ms
            if hopmarks.on:  # about to wait: the marks so far go to their file now, not on a hop
                hopmarks.flush()
            read = await self._xreadgroup(">", capacity, block if block > 0 else None)
            return await self._decode_all(read)
        kept = await self._reread_own(self._pending_cursor, capacity)
        return kept or await self.read(capacity, block_ms)  # none left, or all buried: on to the next ones

    async def _reread_own(self, cursor: str, capacity: int) -> list[Delivery[Message]]:
        """The next of this consumer's own pending entries after ``cursor`` (left by a previous
        run under its name), those past the delivery bound dead-lettered; once none is left, the
        backlog is done and reads go on with new entries."""
        raw = await self._xreadgroup(cursor, capacity, None)
        self._pending_cursor = text(raw[-1][0]) if raw else None
        if not raw:
            return []
        return await self._decode_all(await self._bury_poison([(text(i), f) for i, f in raw]))

    async def read_within(self, capacity: int, wait_ms: float, poll_ms: float = 5.0) -> list[Delivery[Message]]:
        """Up to ``capacity`` entries, waiting at most ``wait_ms`` for them, to within about
        ``poll_ms`` (polling without BLOCK, see ``read``)."""
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            deliveries = await self.read(capacity, block_ms=0)
            left = deadline - time.monotonic()
            if deliveries or left <= 0:
                return deliveries
            await asyncio.sleep(min(left, poll_ms / 1000))

    async def read_raw(self, count: int, block_ms: int | None = None) -> list[tuple[str, Mapping[bytes, bytes]]]:
        """Up to ``count`` new entries, not decoded: for a caller that answers malformed entries
        itself instead of dead-lettering them."""
        raw = await self._xreadgroup(">", count, self._config.block_ms if block_ms is None else block_ms)
        return [(text(entry_id), fields) for entry_id, fields in raw if fields is not None]  # a new entry has fields

    async def ack(self, *entry_ids: str) -> int:
        if not entry_ids:
            return 0
        acked = await self._redis.xack(self.stream, self.group, *entry_ids)
        metrics.ENTRIES_ACKED.labels(self._kind).inc(len(entry_ids))
        return int(acked)

    async def kept_waiting(self, *entry_ids: str) -> None:
        """Pending entries this consumer keeps, unprocessed, to take again later (a reaper's
        tasks that wait for their DP group): their delivery count goes back to one (XCLAIM
        RETRYCOUNT, JUSTID), so being read again pass after pass never makes them poison."""
        if entry_ids:
            await self._redis.xclaim(
                self.stream, self.group, self.consumer, 0, list(entry_ids), retrycount=1, justid=True
            )

    async def dead_letter(self, delivery: Delivery[Message], reason: str, deliveries: int = 1) -> None:
        """Take an entry that its handler could not process out of circulation, with the reason
        (the error's text). Never raises for Redis being away: the letter is kept and sent
        again before the next read (``send_graves``)."""
        await self._bury(delivery.entry_id, codec.encode(delivery.message), reason, deliveries)

    async def send_graves(self) -> None:
        """Send the dead letters Redis refused earlier; raises while it still refuses."""
        while self._graves:
            await self._dead.send(self.stream, self.group, *self._graves[0])
            del self._graves[0]

    async def _bury(self, entry_id: str, fields: Mapping[bytes, bytes], reason: str, deliveries: int) -> None:
        try:
            await self._dead.send(self.stream, self.group, entry_id, fields, reason, deliveries)
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("dead letter for %s %s refused (%s); kept to send again", self.stream, entry_id, exc)
            self._graves.append((entry_id, fields, reason, deliveries))

    def _tell(self, fields: Mapping[bytes, bytes] | None, reason: str) -> None:
        named = codec.request_named_by(fields) if fields is not None else None
        if named is not None and self._on_dead is not None:
            self._on_dead(named, reason)

    async def claim_idle(self, count: int = 100, min_idle_ms: int | None = None) -> list[Delivery[Message]]:
        """Take over entries pending longer than ``min_idle_ms`` with any consumer (XAUTOCLAIM).

        Claimed entries become this consumer's; process and ack them like read ones. An entry
        already delivered ``max_deliveries`` times is dead-lettered instead: it is poison, or
        every consumer that took it died. Safe with several claimers: XAUTOCLAIM re-checks
        idleness atomically, so each entry goes to one of them.
        """
        idle = self._config.claim_idle_ms if min_idle_ms is None else min_idle_ms
        reply = await self._redis.xautoclaim(
            self.stream, self.group, self.consumer, idle, self._claim_cursor, count=count
        )
        cursor, claimed, deleted = autoclaim_parts(reply)
        self._claim_cursor = text(cursor)
        entries = [(text(i), f) for i, f in claimed if f is not None]
        trimmed = [text(i) for i, f in claimed if f is None] + [text(i) for i in deleted]
        metrics.ENTRIES_CLAIMED.labels(self._kind).inc(len(entries))
        return await self._take(entries, trimmed)

    async def pending_ids(self, min_idle_ms: int = 0) -> set[str]:
        """The ids of the entries pending with this consumer (XPENDING: no delivery is counted),
        those delivered at least ``min_idle_ms`` ago only if it is set."""
        reply = await self._redis.xpending_range(
            self.stream,
            self.group,
            min="-",
            max="+",
            count=100_000,
            consumername=self.consumer,
            idle=min_idle_ms or None,
        )
        return {text(row["message_id"]) for row in cast(list[XPendingRow], reply)}

    async def fetch(self, entry_ids: list[str]) -> list[Delivery[Message]]:
        """Entries pending with this consumer, by id, read again without a new delivery (XRANGE):
        for a consumer whose read was delivered by Redis but whose reply it never saw (a timeout
        after a long stop, a dropped connection). One trimmed away meanwhile is acked."""
        pipe = self._redis.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xrange(self.stream, entry_id, entry_id)
        replies = cast(list[list[MaybeEntry]], await pipe.execute())
        found = [(entry_id, rows[0][1] if rows else None) for entry_id, rows in zip(entry_ids, replies, strict=True)]
        trimmed = [entry_id for entry_id, fields in found if fields is None]
        return await self._take([(entry_id, fields) for entry_id, fields in found if fields is not None], trimmed)

    async def _take(self, entries: list[tuple[str, EntryFields]], trimmed: list[str]) -> list[Delivery[Message]]:
        """Entries claimed or fetched again: the trimmed ones are acked (deleted while pending,
        nothing is left to deliver), those past the delivery bound dead-lettered, the rest decoded."""
        if trimmed:
            await self.ack(*trimmed)
        if not entries:
            return []
        return await self._decode_all(await self._bury_poison(entries))

    @property
    def rereading_backlog(self) -> bool:
        """Whether the next reads still re-deliver this consumer's own pending entries (its
        first reads): everything pending with it comes back by them anyway."""
        return self._pending_cursor is not None

    def unsent_letters(self) -> set[str]:
        """Entries this consumer dead-lettered that Redis has not taken yet: still pending."""
        return {entry_id for entry_id, *_ in self._graves}

    async def consumers(self) -> list[ConsumerInfo]:
        """The group's consumers (none if the stream or group does not exist yet)."""
        try:
            reply = await self._redis.xinfo_consumers(self.stream, self.group)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc) and "no such key" not in str(exc):
                raise
            return []
        return [ConsumerInfo(text(r["name"]), r["pending"], r["idle"]) for r in cast(list[XInfoConsumer], reply)]

    async def claim_from(self, owner: str, count: int = 1000) -> list[Delivery[Message]]:
        """Take over up to ``count`` entries pending with ``owner`` (a consumer known to be gone),
        however idle they are. Delivered-too-often entries are dead-lettered as in ``claim_idle``."""
        script = _CLAIM_FROM.register(self._redis)
        reply = cast(ScriptEntries, await script(keys=[self.stream], args=[self.group, owner, self.consumer, count]))
        entries = [(text(i), pairs(f)) for i, f in reply if f]
        trimmed = [text(row[0]) for row in reply if not row[1]]
        metrics.ENTRIES_CLAIMED.labels(self._kind).inc(len(entries))
        return await self._take(entries, trimmed)

    async def owns(self, entry_id: str) -> bool:
        """Whether the entry is pending with this consumer now (not acked, not claimed by another)."""
        rows = await self._redis.xpending_range(
            self.stream, self.group, min=entry_id, max=entry_id, count=1, consumername=self.consumer
        )
        return bool(rows)

    async def forget(self, consumer: str) -> bool:
        """Delete ``consumer`` from the group if nothing is pending with it; whether it was."""
        script = _FORGET.register(self._redis)
        return bool(await script(keys=[self.stream], args=[self.group, consumer]))

    async def _bury_poison(self, entries: Sequence[_Read]) -> list[_Read]:
        counts = await self._delivery_counts([entry_id for entry_id, _ in entries])
        keep = []
        for entry_id, fields in entries:
            deliveries = counts.get(entry_id, 1)
            if deliveries > self._config.max_deliveries and fields is not None:
                bound = self._config.max_deliveries
                reason = f"max_deliveries: delivered {deliveries} times (bound {bound}) without an ack"
                await self._bury(entry_id, fields, reason, deliveries)
                self._tell(fields, reason)
            else:
                keep.append((entry_id, fields))
        return keep

    async def _delivery_counts(self, ids: list[str]) -> dict[str, int]:
        """Delivery counts of entries this consumer owns, in one XPENDING per page of their id
        range (other consumers' entries in the range are filtered out by Redis)."""
        counts: dict[str, int] = {}
        low = ids[0]
        while True:
            reply = await self._redis.xpending_range(
                self.stream, self.group, min=low, max=ids[-1], count=len(ids) + 16, consumername=self.consumer
            )
            rows = cast(list[XPendingRow], reply)
            counts.update({text(r["message_id"]): int(r["times_delivered"]) for r in rows})
            if len(rows) < len(ids) + 16:
                return counts
            low = "(" + text(rows[-1]["message_id"])

    async def _xreadgroup(self, cursor: str, count: int, block: int | None) -> list[MaybeEntry]:
        try:
            reply = await self._xreadgroup_once(cursor, count, block)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                raise
            # The stream or group vanished (e.g. a restart without persistence): recreate it and read
            # nothing; the caller's next read goes on. Redis 7 answers a read blocked on a stream that is
            # deleted meanwhile with UNBLOCKED, 6.2 the next read NOGROUP. Not a retry here: a retried
            # blocked read can be unblocked again, and a key replaced by another type must reach the
            # caller as WRONGTYPE from the recreation, not as a second UNBLOCKED.
            log.warning("group %s on %s missing; recreating", self.group, self.stream)
            await self.ensure_group()
            return []
        return reply[0][1] if reply else []

    async def _xreadgroup_once(self, cursor: str, count: int, block: int | None) -> XReadGroupReply:
        reply = await cluster.xreadgroup(self._redis, self.group, self.consumer, self.stream, cursor, count, block)
        return cast(XReadGroupReply, reply or [])

    async def _decode_all(self, raw: Iterable[MaybeEntry | _Read]) -> list[Delivery[Message]]:
        read_ns = time.time_ns() if hopmarks.on else 0  # the reply is here (hop marks: bench serve)
        deliveries = []
        for entry_id, fields in raw:
            delivery = await self._decode_one(text(entry_id), fields)
            if delivery is not None:
                deliveries.append(delivery)
        if hopmarks.on:
            self._mark(deliveries, read_ns)
        return deliveries

    def _mark(self, deliveries: list[Delivery[Message]], read_ns: int) -> None:
        """Hop marks: each delivery's request read (``KIND.read``) and decoded (``KIND.decoded``)."""
        decoded_ns = time.time_ns()
        for delivery in deliveries:
            hopmarks.mark_message(delivery.message, f"{self._kind}.read", read_ns)
            hopmarks.mark_message(delivery.message, f"{self._kind}.decoded", decoded_ns)

    async def _decode_one(self, entry_id: str, fields: Mapping[bytes, bytes] | None) -> Delivery[Message] | None:
        metrics.ENTRIES_CONSUMED.labels(self._kind).inc()
        if fields is None:  # Redis 6.2: a pending entry that was trimmed away.
            await self.ack(entry_id)
            return None
        published = codec.published_us(fields)
        if published is not None:
            metrics.PUBLISH_TO_READ.labels(self._kind).observe(max(0.0, (codec.now_us() - published) / 1e6))
        try:
            return Delivery(self.stream, entry_id, codec.decode(fields), published)
        except DecodeError as exc:
            log.error("undecodable entry %s on %s: %s", entry_id, self.stream, exc)
            reason = f"undecodable: {exc}"
            await self._bury(entry_id, fields, reason, 1)
            self._tell(fields, reason)
            return None


async def trim_consumed(redis: aioredis.Redis, stream: str) -> int:
    """Delete entries that every group has read and acked; never an unacked one.

    Returns the number of entries deleted. Streams without groups are left alone.
    """
    groups = cast(list[XInfoGroup], await redis.xinfo_groups(stream))
    if not groups:
        return 0
    floor = min([await _group_floor(redis, stream, g) for g in groups], key=entry_order)
    return int(await redis.xtrim(stream, minid=floor, approximate=False))


async def _group_floor(redis: aioredis.Redis, stream: str, group: XInfoGroup) -> str:
    """The smallest id this group still needs: its oldest pending entry, else past the last read."""
    if group["pending"] > 0:
        summary = cast(XPendingSummary, await redis.xpending(stream, text(group["name"])))
        if summary["min"] is not None:  # else all were acked since XINFO: past the last read
            return text(summary["min"])
    ms, seq = entry_order(text(group["last-delivered-id"]))
    return f"{ms}-{seq + 1}"


def entry_order(entry_id: str) -> tuple[int, int]:
    """An entry id as a sort key: (ms, seq)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def unread(redis: aioredis.Redis, stream: str, group: str, limit: int = 100_000) -> int:
    """Entries the group has not read yet (at most ``limit``); ``unread_and_pending``'s first."""
    return (await unread_and_pending(redis, stream, group, limit))[0]


async def unread_and_pending(redis: aioredis.Redis, stream: str, group: str, limit: int = 100_000) -> tuple[int, int]:
    """Entries the group has not read yet (at most ``limit``; Redis 6.2 has no ``lag`` field, so
    they are counted past the group's last-delivered id), and those it read and has not acked
    yet, from one ``XINFO GROUPS``. No stream yet (nobody has written or read it): none."""
    try:
        groups = cast(list[XInfoGroup], await redis.xinfo_groups(stream))
    except ResponseError as exc:
        if "no such key" not in str(exc):
            raise
        return 0, 0
    for info in groups:
        if text(info["name"]) == group:
            pending = int(info.get("pending") or 0)
            lag = info.get("lag")
            if lag is not None:
                return int(lag), pending
            after = "(" + text(info["last-delivered-id"])
            return len(await redis.xrange(stream, min=after, count=limit) or []), pending
    return int(await redis.xlen(stream)), 0
