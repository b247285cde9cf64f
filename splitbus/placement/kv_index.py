"""Which workers hold which KV blocks: a scheduler replica's index, fed by the workers' events.

:class:`KvIndex` is a pure data structure (no Redis): block hash -> the workers that hold it, and
per worker the last event id applied and its stream cursor. Blocks are named by a chained hash
(a block's hash covers every token before it), so a flat map answers prefix questions: a request's
chain of hashes is held by a worker as far as its leading hashes are. :class:`KvIndexFeeder` moves
the bus's batches and snapshots (``splitbus.bus.kv_events``) into it. See docs/routing.md,
"The index".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from splitbus.bus.kv_events import KvEventReader, ReadBatch, Refused
from splitbus.bus.messages.kv_events import (
    MAX_SNAPSHOT_HASHES,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
    batch_bytes,
    snapshot_bytes,
)
from splitbus.placement import metrics

Status = Literal["applied", "gap", "resync", "stale", "overflow"]
"""What became of a batch or snapshot: ``applied``; ``gap`` (an id was missed: the worker is
resynced); ``resync`` (a snapshot replaced the worker's blocks); ``stale`` (already applied, or
read while the worker waits for a snapshot that will cover it); ``overflow`` (it would leave the
worker holding more blocks than it has: refused, its blocks dropped, resynced)."""
UNREPORTED_BLOCKS = 2**16
"""The most blocks the index keeps for a worker whose record reports no ``total_kv_blocks``
(0, or a feeder given no capacities): 1M tokens at 16 a block, ~30 MB of index."""
_NOBODY: frozenset[str] = frozenset()
SILENT_AFTER_S = 10.0
"""A worker routed to that sent no batch for this long (since it was routed to) is silent."""


@dataclass
class _Worker:
    """What the index knows of one worker's stream."""

    instance: str = ""
    """The publisher lifetime applied ("": none yet)."""
    event_id: int = 0
    cursor: str = "0"
    """The stream id of the last entry read: the next read starts after it."""
    resync: bool = True
    """Waiting for a snapshot (a gap, or nothing known yet): batches are not applied."""
    loaded: tuple[str, int] | None = None
    """The snapshot just loaded, until a batch follows it cleanly."""
    bad: tuple[str, int] | None = None
    """A snapshot that was followed by a gap (its stream was trimmed past it): not loaded again."""
    blocks: set[str] = field(default_factory=set)
    predicted: dict[str, float] = field(default_factory=dict)
    """Blocks this replica routed a request's prompt to the worker for, not yet in its events:
    block -> when the prediction lapses (``KvIndex.predict``)."""
    dp_rank: int = -1
    heard_at: float = -float("inf")
    routed_at: float = -float("inf")
    limit: int = UNREPORTED_BLOCKS
    """The most blocks its events may leave it holding (``KvIndex.bound``)."""


def capacity_limit(total_kv_blocks: int) -> int:
    """The most blocks the index keeps for a worker reporting ``total_kv_blocks``: that total (no
    honest worker's events describe more blocks than its pool has: it evicts one before it stores
    another), ``UNREPORTED_BLOCKS`` for none, never more than a snapshot can carry."""
    return min(total_kv_blocks, MAX_SNAPSHOT_HASHES) if total_kv_blocks > 0 else UNREPORTED_BLOCKS


class KvIndex:
    """Block hash -> workers, per worker its event id; pure and single-threaded (asyncio).

    A worker holds a block when its events say so, or when this replica predicted it: a request
    routed to the worker will store its prompt's blocks there, and its siblings (requests with
    the same prefix that arrive before the worker's events do) should follow it. A prediction
    lapses after its time unless an event confirmed the block first."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._holders: dict[str, set[str]] = {}
        self._workers: dict[str, _Worker] = {}
        self._clock = clock

    def workers(self) -> list[str]:
        return list(self._workers)

    def cursor(self, worker: str) -> str:
        return self._state(worker).cursor

    def needs_resync(self, worker: str) -> bool:
        return self._state(worker).resync

    def usable(self, worker: str, snapshot: KvSnapshot) -> bool:
        """Whether loading ``snapshot`` can end the worker's resync: not the one that was
        followed by a gap (a fresh one must be asked for)."""
        return (snapshot.instance, snapshot.event_id) != self._state(worker).bad

    def blocks(self, worker: str) -> int:
        w = self._workers.get(worker)
        return len(w.blocks) if w else 0

    def limit(self, worker: str) -> int:
        """The most blocks ``worker``'s events may leave it holding (``bound``)."""
        w = self._workers.get(worker)
        return w.limit if w else UNREPORTED_BLOCKS

    def refuse(self, worker: str, entry_id: str) -> Status:
        """An entry of ``worker`` too large to hold an honest batch (``batch_bytes``), not decoded:
        "overflow", as if it had been applied. Reading goes on past it."""
        w = self._state(worker)
        w.cursor = entry_id
        return self._overflow(worker, w)

    def bound(self, worker: str, total_kv_blocks: int) -> Status | None:
        """Hold ``worker`` to the blocks its record says it has (``capacity_limit``); "overflow"
        when it holds more already (its total went down): its blocks go, and it resyncs."""
        w = self._state(worker)
        w.limit = capacity_limit(total_kv_blocks)
        return self._overflow(worker, w) if len(w.blocks) > w.limit else None

    def dp_rank(self, worker: str) -> int:
        w = self._workers.get(worker)
        return w.dp_rank if w else -1

    def apply(self, worker: str, entry_id: str, batch: KvEventBatch) -> Status:
        """One batch read from ``worker``'s stream at ``entry_id``."""
        w = self._state(worker)
        w.cursor, w.heard_at, w.dp_rank = entry_id, self._clock(), batch.dp_rank
        if batch.event_id == 1 and batch.instance != w.instance:
            self._replace(worker, w, batch.instance, 0, ())  # a new publisher: its whole history follows
        elif w.resync or (batch.instance == w.instance and batch.event_id <= w.event_id):
            return "stale"
        elif batch.instance != w.instance or batch.event_id != w.event_id + 1:
            return self.lost(worker)
        loaded, w.event_id, w.loaded = w.loaded, batch.event_id, None
        if not self._fold(worker, w, batch.events):
            w.loaded = loaded  # the snapshot it followed must not be loaded again either
            return self._overflow(worker, w)
        return "applied"

    def lost(self, worker: str) -> Status:
        """Events of ``worker`` were lost (an id jumped, an entry was unreadable): resync it. Its
        blocks stay until the snapshot replaces them (approximate beats blind meanwhile)."""
        w = self._state(worker)
        w.resync, w.bad = True, w.loaded or w.bad
        return "gap"

    def load(self, worker: str, snapshot: KvSnapshot) -> Status:
        """Replace ``worker``'s blocks by its snapshot; reading resumes after the snapshot's entry.
        A snapshot of more blocks than the worker has is refused ("overflow"): not loaded, nor
        loaded again (``usable``); the worker stays pending a resync, and is asked for a fresh one."""
        w = self._state(worker)
        if len(snapshot.block_hashes) > w.limit:
            w.bad = (snapshot.instance, snapshot.event_id)
            return "overflow"
        self._replace(worker, w, snapshot.instance, snapshot.event_id, snapshot.block_hashes)
        w.cursor, w.loaded, w.dp_rank, w.heard_at = (
            snapshot.stream_id,
            (snapshot.instance, snapshot.event_id),
            snapshot.dp_rank,
            self._clock(),
        )
        return "resync"

    def drop(self, worker: str) -> None:
        """Forget ``worker`` and every block it held (its lease is gone)."""
        w = self._workers.pop(worker, None)
        for block in w.blocks | w.predicted.keys() if w else ():
            self._unhold(block, worker)

    def retain(self, alive: Collection[str]) -> list[str]:
        """Drop every worker not in ``alive``; returns the dropped."""
        gone = [worker for worker in self._workers if worker not in alive]
        for worker in gone:
            self.drop(worker)
        return gone

    def overlap(self, worker: str, block_hashes: Sequence[str]) -> int:
        """How many leading blocks of a request's chain ``worker`` holds."""
        w = self._workers.get(worker)
        if w is None or not block_hashes or not _holds(w, block_hashes[0]):
            return 0
        return _leading(w, block_hashes)

    def overlaps(self, block_hashes: Sequence[str]) -> dict[str, int]:
        """Every worker holding the chain's first block -> its overlap: ~10 lookups each for a
        1,000-block chain (``_leading``), however long the chain."""
        holders = self._holders.get(block_hashes[0], _NOBODY) if block_hashes else _NOBODY
        return {worker: _leading(self._workers[worker], block_hashes) for worker in holders}

    def decided(self, worker: str, block_hashes: Sequence[str]) -> int:
        """A policy routed a request to ``worker``: its overlap, counted in the scheduler's overlap
        metrics (blocks, decisions by bucket), and the time noted for the silent-worker alarm."""
        n = self.overlap(worker, block_hashes)
        metrics.KV_OVERLAP_BLOCKS.inc(n)
        metrics.KV_DECISIONS.labels(metrics.overlap_bucket(n)).inc()
        self._state(worker).routed_at = self._clock()
        return n

    def predict(self, worker: str, block_hashes: Sequence[str], for_s: float) -> None:
        """A request with this chain was routed to ``worker``: count it as holding the blocks for
        ``for_s`` (until its events confirm them, or the time runs out)."""
        w = self._state(worker)
        until = self._clock() + for_s
        for block in block_hashes:
            if block not in w.blocks:
                w.predicted[block] = until
                self._holders.setdefault(block, set()).add(worker)

    def expire(self) -> int:
        """Drop the predictions whose time ran out; returns how many."""
        now, dropped = self._clock(), 0
        for worker, w in self._workers.items():
            lapsed = [block for block, until in w.predicted.items() if until <= now]
            for block in lapsed:
                del w.predicted[block]
                if block not in w.blocks:
                    self._unhold(block, worker)
            dropped += len(lapsed)
        return dropped

    def silent(self, after_s: float = SILENT_AFTER_S) -> list[str]:
        """Workers routed to that sent no batch since, for ``after_s`` or longer."""
        now = self._clock()
        return [
            worker for worker, w in self._workers.items() if w.routed_at > w.heard_at and now - w.routed_at >= after_s
        ]

    def _state(self, worker: str) -> _Worker:
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker()
        return w

    def _replace(self, worker: str, w: _Worker, instance: str, event_id: int, blocks: Sequence[str]) -> None:
        for block in w.blocks - set(blocks):
            if block not in w.predicted:
                self._unhold(block, worker)
        for block in set(blocks) - w.blocks:
            self._holders.setdefault(block, set()).add(worker)
        w.blocks = set(blocks)
        w.instance, w.event_id, w.resync, w.bad = instance, event_id, False, None

    def _overflow(self, worker: str, w: _Worker) -> Status:
        """``worker``'s events describe more blocks than it has (``_Worker.limit``): a worker that
        lies, or one whose total went down. Its blocks go, and it waits for a snapshot, which is
        loaded only if it is within the limit. Evicting the oldest blocks instead would keep a
        lying worker's index at the limit (and its traffic) for ever; an honest worker never
        gets here (its events never describe more blocks than its pool has, batch by batch)."""
        self._replace(worker, w, w.instance, w.event_id, ())
        w.resync, w.bad = True, w.loaded or w.bad
        return "overflow"

    def _fold(self, worker: str, w: _Worker, events: Sequence[KvEvent]) -> bool:
        """Apply ``events``; False (stopped there) once they leave the worker holding more blocks
        than its limit: checked after each stored run, so an index never holds more than the
        limit and one event's hashes, and that only until ``_overflow`` drops them."""
        for event in events:
            if isinstance(event, BlockStored):
                for block in event.block_hashes:
                    w.blocks.add(block)
                    w.predicted.pop(block, None)  # confirmed
                    self._holders.setdefault(block, set()).add(worker)
                if len(w.blocks) > w.limit:
                    return False
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    w.blocks.discard(block)
                    if block not in w.predicted:
                        self._unhold(block, worker)
            else:
                self._replace(worker, w, w.instance, w.event_id, ())
        return True

    def _unhold(self, block: str, worker: str) -> None:
        holders = self._holders.get(block)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[block]


def _holds(w: _Worker, block: str) -> bool:
    return block in w.blocks or block in w.predicted


def _leading(w: _Worker, chain: Sequence[str]) -> int:
    """How many leading blocks of ``chain`` (whose first block ``w`` holds) ``w`` holds, by
    bisection. A worker's blocks of one chain are a prefix of it: its pool frees a sequence's
    blocks last-first, so it evicts a chain's tail before its head (``BlockPool.release``), and a
    prediction is a whole chain. Where that did not hold, the overlap found is too long: the
    request is placed as if more were cached, and its worker computes what is not (it matches
    the prompt itself)."""
    lo, hi = 1, len(chain)  # it holds chain[:lo]; not beyond chain[:hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _holds(w, chain[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


_COUNTED = {status: metrics.KV_EVENTS.labels(status) for status in ("applied", "gap", "resync", "stale", "overflow")}
"""Each status's counter, looked up once (``labels`` per batch was a tenth of the ingest)."""

REQUEST_EVERY_S = 2.0
"""A feeder asks a worker for a fresh snapshot at most this often while it waits for one."""


class KvIndexFeeder:
    """Keeps a :class:`KvIndex` up to date with the bus: call :meth:`poll` in a loop with the
    workers the registry says are alive (``WorkerInfo.alive``)."""

    def __init__(self, index: KvIndex, reader: KvEventReader, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self._reader = reader
        self._clock = clock
        self._asked: dict[str, float] = {}

    async def poll(
        self,
        alive: Collection[str],
        count: int = 1000,
        block_ms: int | None = None,
        capacities: Mapping[str, int] | None = None,
    ) -> int:
        """Drop dead workers, resync those that need it, read and apply every worker's new
        batches (one ``XREAD``); returns how many entries were read. ``capacities``: each
        worker's ``total_kv_blocks`` as its record reports it, which bounds the blocks the index
        keeps for it (``KvIndex.bound``; a worker not there: ``UNREPORTED_BLOCKS``) and the size
        of the batches it is read (``batch_bytes``) and snapshots (``snapshot_bytes``) decoded."""
        totals = capacities or {}
        self._follow_alive(alive, totals)
        await self._resync(self._due_for_resync(alive))
        cursors = {w: self.index.cursor(w) for w in alive}
        read = await self._reader.read(cursors, count, block_ms, {w: batch_bytes(totals.get(w, 0)) for w in alive})
        for entry in read:
            _COUNTED[self._apply(entry)].inc()
        metrics.KV_SILENT_WORKERS.set(len(self.index.silent()))
        return len(read)

    def _follow_alive(self, alive: Collection[str], totals: Mapping[str, int]) -> None:
        """Forget the workers no longer alive, and hold each live one to its reported blocks."""
        self.index.retain(alive)
        self.index.expire()
        for worker in alive:
            bounded = self.index.bound(worker, totals.get(worker, 0))
            if bounded is not None:
                _COUNTED[bounded].inc()
        for worker in [w for w in self._asked if w not in alive]:
            del self._asked[worker]

    def _due_for_resync(self, alive: Collection[str]) -> list[str]:
        """The live workers that need a resync, but for those asked for a snapshot lately: one is
        looked at again only after a quarter of REQUEST_EVERY_S (it answers within half a second;
        one that publishes none cost a read of its snapshot every poll)."""
        now = self._clock()
        return [
            w for w in alive if self.index.needs_resync(w) and now - self._asked.get(w, -1e9) >= REQUEST_EVERY_S / 4
        ]

    def _apply(self, entry: ReadBatch) -> Status:
        if entry.oversized:
            return self.index.refuse(entry.worker, entry.entry_id)
        if entry.batch is None:
            return self.index.lost(entry.worker)
        return self.index.apply(entry.worker, entry.entry_id, entry.batch)

    async def _resync(self, workers: list[str]) -> None:
        if not workers:
            return
        bounds = {worker: snapshot_bytes(self.index.limit(worker)) for worker in workers}
        for worker, snapshot in (await self._reader.snapshots(workers, bounds)).items():
            status = self._load(worker, snapshot)
            if status is not None:
                _COUNTED[status].inc()
            if status == "resync":
                self._asked.pop(worker, None)
            elif self._clock() - self._asked.get(worker, -float("inf")) >= REQUEST_EVERY_S:
                self._asked[worker] = self._clock()
                await self._reader.request_snapshot(worker)

    def _load(self, worker: str, snapshot: KvSnapshot | Refused | None) -> Status | None:
        """Load a snapshot read for a resync: its status, None when there was none to load."""
        if snapshot is Refused.OVERSIZED:
            return "overflow"
        if snapshot is None or not self.index.usable(worker, snapshot):
            return None
        return self.index.load(worker, snapshot)
