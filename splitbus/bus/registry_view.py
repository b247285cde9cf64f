"""A registry view kept current by the registry log, ``sb:registry:{cell}``.

Every write to the registry also appends an entry to the log (in the same script or pipeline):
a worker's beat (its lease and load, or its whole record when it registers), a load report with
the reservations it gives back, a scheduler's reservation (the dispatch script), a departure.
A view reads a snapshot once (``Registry.snapshot_at``: the records, the server's time and the
log's last entry, atomically), then follows the log from that entry with one blocking ``XREAD``
at a time and applies each change as it comes: a scheduler or API node sees a worker's load and
every replica's reservations within a read's round trip and ``SETTLE_S``, and no arrival waits on a refresh.
Every ``full_every_s`` it reads a snapshot again, to repair drift (a change the log trimmed
before it was read, a worker that registered while the view was away).

Liveness is each worker's lease as the log and snapshots give it (the server's time of its last
beat plus its lease), measured on the server's clock as the last snapshot read it plus the
monotonic time since: a worker that stops beating drops out of ``live`` when its lease runs out,
with no entry to say so. The dispatch script checks the lease itself, so a view that is a moment
late never gets a task written for a dead worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from splitbus.bus.core import codec, follow, metrics
from splitbus.bus.core.connection import is_transient
from splitbus.bus.records import Reserved
from splitbus.bus.registry import (
    LOAD_FIELDS,
    LOG_AT,
    LOG_LEASE,
    LOG_OP,
    LOG_WORKER,
    RESERVED_FIELDS,
    LogOp,
    Registry,
    Snapshot,
    WorkerInfo,
    WorkerRecord,
    change_field,
    load_fields,
    parse_int,
    reserved,
)

log = logging.getLogger(__name__)

FULL_EVERY_S = 5.0
"""How often a view reads a whole snapshot again (drift repair)."""
BLOCK_MS = 100
"""How long one read of the log waits for a change."""
SETTLE_S = 0.005
"""How long a view waits, after a read that brought changes, before it reads again: what is
written meanwhile comes in one read. A busy cell would otherwise wake every view once per change
(256 workers beat 512 times a second, and a scheduler reads back each of its own reservations),
each wake a round trip of CPU in every scheduler and API node; a view is then at most this much
later. Measured with ``bench scheduler`` (256 workers, 500 req/s): a scheduler's CPU 50–60 % with
it, 60–66 % without (docs/benchmarks.md)."""
READ_COUNT = 5000
"""Log entries one read takes at most; a full read means the view is behind (not caught up)."""
_LOAD = set(LOAD_FIELDS)
_DEAD_TTL = -2


@dataclass
class _Row:
    """One worker as the view knows it."""

    record: WorkerRecord
    heartbeat_ms: int
    lease_until_ms: int
    """The server time its lease runs out at (0: none)."""
    reserved: Reserved


class RegistryView:
    """The registry, as of its log's latest change: ``workers`` (every registered worker, alive or
    not, as ``WorkerInfo`` rows), ``live()``."""

    def __init__(
        self,
        registry: Registry,
        redis: aioredis.Redis,
        full_every_s: float = FULL_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        settle_s: float = SETTLE_S,
    ) -> None:
        self._registry = registry
        self._redis = redis
        self._log_key = registry.log_key
        self._full_every_s = full_every_s
        self._settle_s = settle_s
        self._clock = clock
        self._rows: dict[str, _Row] = {}
        self._cursor = "0-0"
        self._full_at = -float("inf")
        self._server_ms = 0
        """The server's clock at ``_synced_at`` (from the last snapshot)."""
        self._known_ms = 0
        """The server time up to which the view has read every change: leases are judged at it
        (at most ``BLOCK_MS`` behind while the view keeps reading), never past it. A view that
        did not read for a while (its process stopped, Redis away) must not find every worker
        dead because it missed their beats."""
        self._synced_at = 0.0
        self._built: list[WorkerInfo] | None = None
        self._infos: dict[str, WorkerInfo] = {}
        """The rows last built, by worker: a change rebuilds only its worker's."""
        self._changed: set[str] = set()
        self._valid_until_ms = 0
        """The server time the built rows' liveness holds until (the next lease to run out)."""
        self.read_at = 0.0
        """When the read behind the view began (monotonic): it shows every change written before."""
        self.redis_ok = False
        self.refreshed = asyncio.Event()
        """Set after each read that changed the view (a replica forgets the reservations it shows)."""
        self.stopped = False

    # ------------------------------------------------------------ reading

    async def refresh(self) -> None:
        """Read a whole snapshot (at start, every ``full_every_s``, and after a gap)."""
        await self._guarded(self._full)

    async def follow(self) -> None:
        """One step of the view's loop: a snapshot when one is due, else one blocking read of the
        log's changes since the last one."""
        if self._clock() - self._full_at >= self._full_every_s:
            await self.refresh()
        else:
            await self._guarded(self._changes)

    async def run(self) -> None:
        while not self.stopped:
            await self.follow()
            if not self.redis_ok:
                await asyncio.sleep(BLOCK_MS / 1000)

    def stop(self) -> None:
        self.stopped = True

    async def _guarded(self, read: Callable[[], Awaitable[None]]) -> None:
        try:
            await read()
            self.redis_ok = True
        except Exception as exc:
            if not is_transient(exc):  # BUSY or a refused script is a ResponseError, not a connection error
                raise
            if self.redis_ok:
                log.warning("registry view: %s", exc)
            self.redis_ok = False
            self._full_at = -float("inf")  # back from an outage: a snapshot first
        self.refreshed.set()

    async def _full(self) -> None:
        read_at = self._clock()
        snapshot: Snapshot = await self._registry.snapshot_at()
        self._server_ms, self._synced_at = snapshot.server_ms, read_at
        self._rows = {
            w.record.worker_id: _Row(
                w.record,
                w.heartbeat_ms,
                snapshot.server_ms + w.lease_ttl_ms if w.lease_ttl_ms > 0 else 0,
                w.reserved,
            )
            for w in snapshot.workers
        }
        self._cursor, self._full_at, self.read_at, self._built = snapshot.log_id, read_at, read_at, None
        self._known_ms = snapshot.server_ms

    async def _changes(self) -> None:
        read_at = self._clock()
        entries = await follow.read_after(self._redis, {self._log_key: self._cursor}, READ_COUNT, BLOCK_MS)
        for _, entry_id, fields in entries:
            self._apply(codec.flat_text(fields))
            self._cursor = entry_id
        if len(entries) < READ_COUNT:  # caught up: every change written before the read is in
            self.read_at = read_at
            started_ms = self._server_ms + int((read_at - self._synced_at) * 1000)
            self._known_ms = max(self._known_ms, started_ms)
        elif entries:
            self._known_ms = max(self._known_ms, int(self._cursor.split("-", 1)[0]))
        if entries and self._settle_s > 0:
            await asyncio.sleep(self._settle_s)

    # ------------------------------------------------------------ applying

    def _apply(self, fields: dict[str, str]) -> None:
        """One log entry. One it cannot read (a field missing, malformed or out of range) takes
        its worker out of the view, counted: what its hash holds is not known to be sane, and a
        worker shown with its last good load would go on drawing work meanwhile. The next
        snapshot (``full_every_s``) brings it back if its record is good by then."""
        worker, op = fields.pop(LOG_WORKER, ""), fields.pop(LOG_OP, "")
        self._changed.add(worker)
        try:
            if op == LogOp.BEAT:
                self._beat(worker, fields)
            elif op in (LogOp.LOAD, LogOp.RESERVE):
                self._load(worker, fields)
            elif op == LogOp.GONE:
                self._rows.pop(worker, None)
            elif op == LogOp.RESIGN and worker in self._rows:
                self._rows[worker].lease_until_ms = 0
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("registry view: dropping %s for an unreadable %s entry: %.200s", worker or "?", op or "?", exc)
            metrics.REGISTRY_ROWS_REJECTED.labels("log").inc()
            self._rows.pop(worker, None)

    def _beat(self, worker: str, fields: dict[str, str]) -> None:
        at, lease = parse_int(fields.pop(LOG_AT), "heartbeat_ms"), parse_int(fields.pop(LOG_LEASE), "lease_ms")
        row = self._rows.get(worker)
        if row is None:
            if "role" not in fields:
                return  # a beat of a worker registered while this view was away: the next snapshot has it
            row = self._rows[worker] = _Row(WorkerRecord.from_hash(fields), at, 0, Reserved())
        elif "role" in fields:
            row.record = _with_experts_of(row.record, WorkerRecord.from_hash(fields))
        else:
            row.record = _with_load(row.record, fields)
        row.heartbeat_ms, row.lease_until_ms = at, at + lease

    def _load(self, worker: str, fields: dict[str, str]) -> None:
        row = self._rows.get(worker)
        if row is None:
            return
        row.record = _with_load(row.record, fields)
        change = {name: parse_int(fields.get(change_field(name), "0"), name) for name in RESERVED_FIELDS}
        if any(change.values()):
            row.reserved = reserved({name: getattr(row.reserved, name) + change[name] for name in RESERVED_FIELDS})

    # ------------------------------------------------------------ the view

    def server_ms(self) -> int:
        """The server's clock now, as this view estimates it."""
        return self._server_ms + int((self._clock() - self._synced_at) * 1000)

    def lease_clock_ms(self) -> int:
        """The server time leases are judged at: now, but never past what the view has read up to
        (plus the one read's block and the settling wait it may be behind)."""
        return min(self.server_ms(), self._known_ms + BLOCK_MS + int(self._settle_s * 1000))

    @property
    def workers(self) -> list[WorkerInfo]:
        """Every registered worker, alive or not. The same list object until the view changes
        (a policy keeps what it derives from it per list)."""
        now = self.lease_clock_ms()
        if self._built is None or now >= self._valid_until_ms:
            self._infos = {worker: _info(row, now) for worker, row in self._rows.items()}
            ends = [row.lease_until_ms for row in self._rows.values() if row.lease_until_ms > now]
            self._valid_until_ms = min(ends, default=now + 1000)
        elif self._changed:  # a lease that runs out in the meantime is caught by _valid_until_ms next
            for worker in self._changed:
                row = self._rows.get(worker)
                if row is None:
                    self._infos.pop(worker, None)
                else:
                    self._infos[worker] = _info(row, now)
                    self._valid_until_ms = min(self._valid_until_ms, row.lease_until_ms or self._valid_until_ms)
        else:
            return self._built
        self._changed.clear()
        self._built = list(self._infos.values())
        return self._built

    @workers.setter
    def workers(self, rows: list[WorkerInfo]) -> None:
        """Put these rows in the view, as a snapshot would (tests, hand-made views)."""
        now = self.lease_clock_ms()
        self._rows = {
            w.record.worker_id: _Row(w.record, w.heartbeat_ms, now + w.lease_ttl_ms if w.alive else 0, w.reserved)
            for w in rows
        }
        self._built = None

    def live(self) -> list[WorkerInfo]:
        return [w for w in self.workers if w.alive]

    def live_models(self) -> list[str]:
        return sorted({w.record.model for w in self.live()})

    def serves(self, model: str) -> bool:
        return any(w.record.model == model for w in self.live())


def _info(row: _Row, now_ms: int) -> WorkerInfo:
    ttl = row.lease_until_ms - now_ms if row.lease_until_ms else _DEAD_TTL
    return WorkerInfo(row.record, row.heartbeat_ms, ttl if ttl > 0 else _DEAD_TTL, row.reserved)


def _with_experts_of(before: WorkerRecord, record: WorkerRecord) -> WorkerRecord:
    """``record``, read from a beat, with the expert load of the record it replaces: the log does
    not carry expert loads (``EXPERT_FIELDS``), so a view holds each worker's as of its last
    snapshot rather than losing it at the next beat."""
    if before.load.experts is None:
        return record
    return dataclasses.replace(record, load=dataclasses.replace(record.load, experts=before.load.experts))


def _with_load(record: WorkerRecord, fields: dict[str, str]) -> WorkerRecord:
    """The record with the load fields among ``fields`` changed: a new record (the rows built
    before keep theirs), or the same one when there are none."""
    changed: dict[str, Any] = load_fields(fields, _LOAD.intersection(fields))  # integers: never ``experts``
    if not changed:
        return record
    return dataclasses.replace(record, load=dataclasses.replace(record.load, **changed))
