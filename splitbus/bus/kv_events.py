"""KV cache events: ``sb:kv-events:{cell}:<worker>`` and ``sb:kv-snapshot:{cell}:<worker>``.

A worker's :class:`KvEventPublisher` writes one :class:`KvEventBatch` per engine step that
changed its prefix cache (one ``XADD ... MAXLEN ~``), and keeps the set of blocks its batches
describe, which it writes as a :class:`KvSnapshot` periodically and when a scheduler asks
(``requested`` on the snapshot hash). Every scheduler replica reads every worker's stream with a
:class:`KvEventReader`, without a consumer group (each replica keeps its own index and cursor):
one ``XREAD`` for every worker, their streams sharing the cell's slot. See docs/routing.md,
"KV events".
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from enum import Enum
from typing import cast

import redis.asyncio as aioredis

from splitbus.bus.core import codec, follow
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.errors import DecodeError
from splitbus.bus.core.replies import EntryFields, for_xadd, text
from splitbus.bus.messages.kv_events import (
    MAX_BATCH_EVENTS,
    MAX_BATCH_HASHES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
    batch_hashes,
)

log = logging.getLogger(__name__)

EVENTS_MAXLEN = 10_000
"""Batches kept per worker (``MAXLEN ~``): at one batch per step, seconds to a minute of steps;
a replica that falls further behind resyncs from the snapshot."""
SNAPSHOT_EVERY_S = 30.0
"""A publisher writes its snapshot at least this often (also when asked)."""
REQUEST_POLL_S = 0.5
"""How often a publisher looks for a scheduler's request for a snapshot (one ``HGET``)."""
KEYS_TTL_S = 3600
"""Both keys expire this long after the publisher's last refresh: a dead worker's go."""
REQUESTED = b"requested"


def _size(event: KvEvent) -> int:
    return 0 if isinstance(event, AllBlocksCleared) else len(event.block_hashes)


def _pieces(events: Sequence[KvEvent], max_hashes: int) -> Iterator[KvEvent]:
    """``events``, an event with more than ``max_hashes`` hashes cut into chained pieces."""
    for event in events:
        if isinstance(event, AllBlocksCleared) or len(event.block_hashes) <= max_hashes:
            yield event
            continue
        hashes = event.block_hashes
        for i in range(0, len(hashes), max_hashes):
            chunk = hashes[i : i + max_hashes]
            if isinstance(event, BlockRemoved):
                yield BlockRemoved(chunk)
            else:
                yield BlockStored(chunk, event.parent_block_hash if i == 0 else hashes[i - 1], event.block_size)


def split_batches(
    events: Sequence[KvEvent], max_hashes: int = MAX_BATCH_HASHES, max_events: int = MAX_BATCH_EVENTS
) -> list[list[KvEvent]]:
    """``events`` in order, as few batches as the bounds allow (one, for any real step)."""
    batches: list[list[KvEvent]] = [[]]
    room = max_hashes
    for event in _pieces(events, max_hashes):
        if _size(event) > room or len(batches[-1]) >= max_events:
            batches.append([])
            room = max_hashes
        batches[-1].append(event)
        room -= _size(event)
    return [batch for batch in batches if batch]


def fold(cached: set[str], events: Sequence[KvEvent]) -> None:
    """Apply ``events`` to a set of cached block hashes."""
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        else:
            cached.clear()


class KvEventPublisher:
    """One worker's (or DP rank's) writer of its cache events and snapshot.

    The worker calls :meth:`publish` once per engine step with that step's events, in the order
    the cache made them, and :meth:`maybe_snapshot` as often (it sends nothing unless due). A new
    publisher starts a new ``instance``; its first batch should be ``AllBlocksCleared`` (what
    :meth:`start` sends) so that a scheduler drops what an earlier process of the id held.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        config: BusConfig,
        worker_id: str,
        dp_rank: int = -1,
        *,
        maxlen: int = EVENTS_MAXLEN,
        snapshot_every_s: float = SNAPSHOT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        total_kv_blocks: int = 0,
    ) -> None:
        self._redis = redis
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.stream = config.keys.kv_events(worker_id)
        self.snapshot_key = config.keys.kv_snapshot(worker_id)
        self.instance = uuid.uuid4().hex
        self._maxlen = maxlen
        self._max_hashes = batch_hashes(total_kv_blocks)
        """Its batches' bound (hashes, and events), which readers hold it to: ``batch_bytes``."""
        self._every_s = snapshot_every_s
        self._clock = clock
        self._cached: set[str] = set()
        self.event_id = 0
        """The id of the last batch sent (0: none yet)."""
        self._stream_id = "0"
        self._past_snapshot = False
        """After a new run: the next batch takes an id past the snapshot's (``_entry_id``)."""
        self._snapshot_at = self._polled_at = self._refreshed_at = -float("inf")

    @property
    def cached(self) -> Set[str]:
        """The blocks the batches sent so far describe: what the snapshot holds."""
        return self._cached

    async def start(self) -> None:
        """Announce a fresh cache (``AllBlocksCleared``, unless a batch went out already: safe
        to repeat after a Redis error) and write the first snapshot."""
        if self.event_id == 0:
            await self.publish([AllBlocksCleared()])
        await self.write_snapshot()

    async def publish(self, events: Sequence[KvEvent]) -> int:
        """Send one step's events: one ``XADD`` (none for no events; more only for a step beyond
        the batch bounds). Returns the last event id sent."""
        for batch in split_batches(events, self._max_hashes, min(self._max_hashes, MAX_BATCH_EVENTS)):
            await self._send(batch)
        return self.event_id

    async def _send(self, events: list[KvEvent]) -> None:
        batch = KvEventBatch(self.worker_id, self.instance, self.event_id + 1, events, self.dp_rank)
        entry_id = await self._entry_id()
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(self.stream, for_xadd(codec.encode(batch)), id=entry_id, maxlen=self._maxlen, approximate=True)
        refresh = self._clock() - self._refreshed_at >= KEYS_TTL_S / 4
        if refresh:
            pipe.expire(self.stream, KEYS_TTL_S)
        replies = await pipe.execute()
        self.event_id += 1
        self._stream_id, self._past_snapshot = text(replies[0]), False
        self._refreshed_at = self._clock() if refresh else self._refreshed_at
        fold(self._cached, events)

    async def _entry_id(self) -> str:
        """``*``; after a new run, the id just past both the snapshot's and the stream's last one.
        A run that lost the stream recreates it at the next ``XADD``, whose ``*`` id is the
        server's time: within the millisecond of the snapshot's batch it was that very id (151
        times in 200 on loopback), and a reader resuming after the snapshot never read the batch."""
        if not self._past_snapshot:
            return "*"
        last = cast("list[tuple[bytes, object]]", await self._redis.xrevrange(self.stream, count=1))
        ms, seq = max([_parse_id(self._stream_id), *(_parse_id(text(entry_id)) for entry_id, _ in last)])
        return f"{ms}-{seq + 1}"

    async def maybe_snapshot(self) -> bool:
        """Write the snapshot if it is due (every ``snapshot_every_s``) or a scheduler asked for
        one (looked for every ``REQUEST_POLL_S``); whether it wrote one."""
        now = self._clock()
        due = now - self._snapshot_at >= self._every_s
        if not due and now - self._polled_at >= REQUEST_POLL_S:
            self._polled_at = now
            due = await self._redis.hget(self.snapshot_key, REQUESTED.decode()) is not None
        if due:
            await self.write_snapshot()
        return due

    async def after_new_run(self) -> None:
        """Redis has a new server run, which may have lost the latest batches, the snapshot and
        the stream itself: write the snapshot now (a reader that sees the gap resyncs from it at
        once) and set the stream's TTL again with the next batch (an ``XADD`` that recreates it
        sets none)."""
        self._refreshed_at, self._past_snapshot = -float("inf"), True
        await self.write_snapshot()

    async def write_snapshot(self) -> None:
        """Write the whole set of cached blocks, as of the last batch sent; clears a request."""
        snapshot = KvSnapshot(
            self.worker_id, self.instance, self.event_id, self._stream_id, sorted(self._cached), self.dp_rank
        )
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(self.snapshot_key, mapping=for_xadd(codec.encode(snapshot)))
        pipe.hdel(self.snapshot_key, REQUESTED.decode())
        pipe.expire(self.snapshot_key, KEYS_TTL_S)
        await pipe.execute()
        self._snapshot_at = self._clock()


@dataclass(frozen=True)
class ReadBatch:
    """One entry of a worker's event stream, as a reader got it."""

    worker: str
    entry_id: str
    """Its stream id: the reader's cursor moves past it."""
    batch: KvEventBatch | None
    """None when the entry could not be decoded (``error`` says why): the reader must resync."""
    error: str = ""
    oversized: bool = False
    """Its data was larger than the reader's bound for the worker: not decoded (``batch`` None)."""


class Refused(Enum):
    """A snapshot a reader did not read."""

    OVERSIZED = "oversized"
    """Its data is larger than the reader's bound for the worker."""


class KvEventReader:
    """A scheduler replica's reader of every worker's events and snapshots."""

    def __init__(self, redis: aioredis.Redis, config: BusConfig) -> None:
        self._redis = redis
        self._keys = config.keys

    async def read(
        self,
        cursors: Mapping[str, str],
        count: int = 1000,
        block_ms: int | None = None,
        max_bytes: Mapping[str, int] | None = None,
    ) -> list[ReadBatch]:
        """The entries after each worker's cursor (a stream id, "0": from the start), at most
        ``count`` per worker, in one ``XREAD`` (blocking up to ``block_ms``, at least 1 ms; None: not at all).
        An entry whose data is larger than ``max_bytes[worker]`` (``batch_bytes`` of its total)
        is not decoded (``oversized``)."""
        by_key = {self._keys.kv_events(worker): worker for worker in cursors}
        streams = {key: cursors[worker] for key, worker in by_key.items()}
        return [
            _read_batch(by_key[key], entry_id, fields, max_bytes or {})
            for key, entry_id, fields in await follow.read_after(self._redis, streams, count, block_ms)
        ]

    async def snapshots(
        self, workers: Collection[str], max_bytes: Mapping[str, int] | None = None
    ) -> dict[str, KvSnapshot | Refused | None]:
        """Each worker's snapshot, None where there is none (or it is unreadable: logged), and
        ``OVERSIZED`` where its data is larger than ``max_bytes[worker]`` (not decoded)."""
        pipe = self._redis.pipeline(transaction=False)
        for worker in workers:
            pipe.hgetall(self._keys.kv_snapshot(worker))
        replies = await pipe.execute() if workers else []
        bounds = max_bytes or {}
        return {
            worker: _snapshot(worker, raw, bounds.get(worker, codec.MAX_DATA_BYTES))
            for worker, raw in zip(workers, replies, strict=True)
        }

    async def request_snapshot(self, worker: str) -> None:
        """Ask ``worker``'s publisher for a fresh snapshot (it answers within ``REQUEST_POLL_S``
        of its next step)."""
        key = self._keys.kv_snapshot(worker)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(key, REQUESTED.decode(), str(codec.now_us()))
        pipe.expire(key, KEYS_TTL_S)
        await pipe.execute()


def _parse_id(entry_id: str) -> tuple[int, int]:
    """A stream id's (ms, seq); ``0`` (no batch sent) is (0, 0)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _read_batch(worker: str, entry_id: str, fields: EntryFields, max_bytes: Mapping[str, int]) -> ReadBatch:
    size, bound = codec.data_size(fields), max_bytes.get(worker, codec.MAX_DATA_BYTES)
    if size > bound:
        return ReadBatch(worker, entry_id, None, f"data is {size} bytes, more than {bound}", oversized=True)
    try:
        batch = codec.decode(fields)
    except DecodeError as exc:
        return ReadBatch(worker, entry_id, None, str(exc))
    if not isinstance(batch, KvEventBatch) or batch.worker != worker:
        return ReadBatch(worker, entry_id, None, f"not a kv_events batch of {worker}")
    return ReadBatch(worker, entry_id, batch)


def _snapshot(worker: str, raw: EntryFields, max_bytes: int) -> KvSnapshot | Refused | None:
    if b"type" not in raw:
        return None
    if codec.data_size(raw) > max_bytes:
        return Refused.OVERSIZED
    try:
        snapshot = codec.decode(raw)
    except DecodeError as exc:
        log.warning("unreadable KV snapshot of %s: %s", worker, exc)
        return None
    if not isinstance(snapshot, KvSnapshot) or snapshot.worker != worker:
        log.warning("the KV snapshot key of %s holds something else", worker)
        return None
    return snapshot
