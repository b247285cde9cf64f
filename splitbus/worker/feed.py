"""The task feed, a bus edge: take tasks from this worker's stream while there is room, each
once, whatever happened to the read that brought it; check each one, reserve its blocks, and
give the scheduler back what it reserved for it. Also what a worker back from a lapsed lease
drops: the tasks a reaper took while it was out."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from splitbus import tracing
from splitbus.bus.core import hopmarks
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import is_transient
from splitbus.bus.core.streams import Delivery, GroupConsumer, entry_order
from splitbus.bus.messages import GenerateRequest
from splitbus.bus.records import Reserved
from splitbus.bus.registry import Registry
from splitbus.bus.reservations import Reservations
from splitbus.bus.tasks import missing_entries, trim_tasks
from splitbus.worker import spans
from splitbus.worker.core import Admission, AdmissionFailed, WorkerCore
from splitbus.worker.outbox import NewRun, Outbox
from splitbus.worker.sequence import Sequence

log = logging.getLogger(__name__)
TRIM_EVERY_S = 5.0
SEEN_KEPT = 10_000
"""How many task entries taken lately are remembered (a lost one found again is not taken twice)."""


class TaskFeed:
    """``feed_tasks``, ``find_lost_tasks`` and ``trim_tasks`` are loop steps. What a task comes to
    is the core's (``WorkerCore.admit``); the feed reads, dead-letters, writes a decode task's
    KV reservation and gives the scheduler's reservations back; the core's effects go to
    ``outbox`` (its ``done_entries``, acked next, count as seen: never taken again).
    ``work_arrived`` is called once tasks were taken (the stepper's: a DP rank wakes its group)."""

    def __init__(
        self,
        core: WorkerCore,
        redis: aioredis.Redis,
        bus: BusConfig,
        tasks: GroupConsumer,
        registry: Registry,
        reservations: Reservations,
        outbox: Outbox,
        *,
        max_requests: int,
        work_arrived: Callable[[], Awaitable[None]],
        new_run: NewRun,
    ) -> None:
        self.core, self.id, self.redis, self.bus, self.keys = core, core.id, redis, bus, bus.keys
        self.tasks, self.registry, self.max_requests = tasks, registry, max_requests
        self.apply, self.done_entries, self.work_arrived = outbox.apply, outbox.done_entries, work_arrived
        self.reservations = reservations
        self.room = outbox.room
        """Set when a request left: the feed, full, waits on it to read again."""
        self.unreturned = Reserved()  # reservations of tasks taken, not given back yet
        self.unaccepted: deque[Delivery] = deque()  # tasks read, not taken yet
        self.reread_pending = False  # a task read failed: its reply may have held tasks (take_lost)
        self.seen_entries: dict[str, None] = {}  # task entries taken lately, oldest first (bounded)
        self.new_run = new_run
        """Redis has a new server run whose recovery is not done (``owed``, the recovery's): a held
        task's entry missing from the stream was lost with the run, not moved by a reaper."""

    async def drop_moved(self) -> None:
        """Drop every task the reaper took: those no longer pending to this worker. In place: a
        read still in flight adds what it brings to this same backlog (a task written while the
        reaper worked is this worker's)."""
        before = self.known_entries()  # what arrives while XPENDING is on its way is this worker's
        mine = await self.tasks.pending_ids()
        kept = [d for d in self.unaccepted if d.entry_id in mine or d.entry_id not in before]
        self.unaccepted.clear()
        self.unaccepted.extend(kept)
        moved = await self.moved(before, mine)
        for seq in moved:
            self.apply(self.core.moved_away(seq, reapers=True))
        log.warning("worker %s: %d request(s) moved away while it was out: dropped", self.id, len(moved))
        await self.take_lost()

    async def moved(self, before: set[str], mine: set[str]) -> list[Sequence]:
        """The held tasks no longer pending to this worker (of those it knew of before it asked).
        After a new Redis run, a task whose entry is gone from the stream was lost with the run,
        not moved: a moved task's entry is still there (claimed, or acked)."""
        moved = [seq for seq in self.core.table.of() if seq.entry_id not in mine and seq.entry_id in before]
        if self.new_run.owed:
            lost = await missing_entries(self.redis, self.keys, self.id, [seq.entry_id for seq in moved])
            moved = [seq for seq in moved if seq.entry_id not in lost]
        return moved

    async def find_lost_tasks(self) -> None:
        """Now and then, take tasks lost without an error: redis-py retries a read whose reply
        timed out (a stop, a stall past the socket timeout) and returns the retry's reply, while
        Redis had delivered entries to the first. Only entries older than a read and its timeout
        are looked at, so none that a read in flight is bringing."""
        await asyncio.sleep(self.bus.socket_timeout_s)
        await self.take_lost(int(self.bus.socket_timeout_s * 1000) + self.bus.block_ms)

    async def take_lost(self, min_idle_ms: int = 0) -> None:
        """Take the tasks pending to this worker that it has never seen: Redis delivered them to
        a read whose reply was lost (it timed out after a long stop, or its connection dropped).
        Nobody else would: a live worker's pending entries are not claimed."""
        if not self.tasks.rereading_backlog:  # else its next reads bring back all that is pending anyway
            lost = sorted(await self.tasks.pending_ids(min_idle_ms) - self.known_entries(), key=entry_order)
            if lost:
                log.warning(
                    "worker %s: %d task(s) delivered to a read whose reply was lost; taking them", self.id, len(lost)
                )
                self.unaccepted.extend(await self.tasks.fetch(lost))
        if not min_idle_ms:
            self.reread_pending = False  # only now: a Redis error above leaves it to the next feed

    def known_entries(self) -> set[str]:
        """Task entries this worker has seen: held, in its backlog, taken lately (done, perhaps
        acked already), or dead-lettered with the letter not sent yet."""
        held = {s.entry_id for s in self.core.table.of()}
        return (
            held
            | {d.entry_id for d in self.unaccepted}
            | set(self.done_entries)
            | set(self.seen_entries)
            | self.tasks.unsent_letters()
        )

    def saw(self, entry_id: str) -> None:
        self.seen_entries[entry_id] = None
        while len(self.seen_entries) > SEEN_KEPT:
            del self.seen_entries[next(iter(self.seen_entries))]

    async def feed_tasks(self) -> None:
        """Read tasks, only while there is room for them. What was read is taken from a backlog,
        so a Redis refusal while taking one task (a decode worker writes its KV reservation)
        leaves the tasks read with it to be taken once Redis is back, not dropped."""
        if self.reread_pending:
            await self.take_lost()
        if not self.unaccepted:
            room = self.max_requests - self.core.held()
            if room <= 0:
                self.room.clear()
                await self.room.wait()
                return
            try:
                read = await self.tasks.read(room)
            except Exception as exc:
                self.reread_pending = is_transient(exc)  # its reply may have held tasks: look for them
                raise
            self.unaccepted.extend(read)
        while self.unaccepted and self.core.kv_room_for(self.unaccepted[0].message):
            await self.accept_safely(self.unaccepted.popleft())
        await self.work_arrived()
        # The engine loop starts on them first (the next turn of the loop is its), then the
        # reservations go back while it runs: a first token does not wait for that write.
        await asyncio.sleep(0)
        await self.give_back_reservations()
        if self.unaccepted:  # no KV blocks for the next one yet: it waits, read, until a request leaves
            self.room.clear()
            await self.room.wait()

    async def give_back_reservations(self) -> None:
        """Give back what the scheduler reserved for the tasks taken, with the load that now
        counts them: until the next heartbeat the tasks would otherwise be in neither. Kept
        until Redis takes it (the publisher tries again): a lost give-back would leave this
        worker looking busier for good."""
        taken, self.unreturned = self.unreturned, Reserved()
        if taken == Reserved():
            return
        try:
            await self.registry.report_load(self.id, self.core.load(), taken)
        except BaseException:
            self.unreturned = _add(self.unreturned, taken)
            raise

    async def accept_safely(self, delivery: Delivery) -> None:
        """Take one task. One that cannot be handled fails its request alone (an error entry
        for its client, a dead letter with the reason); the worker goes on."""
        try:
            await self.accept(delivery)
        except Exception as exc:
            if is_transient(exc):
                raise
            log.exception("task %s failed as it was taken", delivery.entry_id)
            await self.reject(delivery, "handler_failed", f"{type(exc).__name__}: {exc}")

    async def accept(self, delivery: Delivery) -> None:
        """Take one task entry, once: the core says what it comes to (``WorkerCore.admit``)."""
        if delivery.entry_id in self.seen_entries:  # taken as lost while its read's reply was on its way
            return
        self.saw(delivery.entry_id)
        try:
            admission = self.core.admit(delivery.entry_id, delivery.message)
        except AdmissionFailed as failed:
            self.take_back(failed.so_far)
            self.apply(failed.so_far.effects)
            raise failed.cause from None
        self.take_back(admission)
        if admission.rejected is not None:
            await self.reject(delivery, *admission.rejected)
            return
        self.apply(admission.effects)
        if hopmarks.on:
            hopmarks.mark_message(delivery.message, "worker.taken")
        if tracing.on:
            spans.taken(self.core.table, delivery)
        if admission.awaiting_kv is not None:
            await self.reserve_kv(admission.awaiting_kv)

    def take_back(self, admission: Admission) -> None:
        """The reservation a task brought, to give back with the next load report."""
        if admission.reserved is not None:
            self.unreturned = _add(self.unreturned, admission.reserved)

    async def reserve_kv(self, seq: Sequence) -> None:
        """A decode task with its blocks: its reservation in ``sb:kv``, for its dispatch."""
        if not await self.reservations.reserve(seq.request_id, self.core.reservation_of(seq)):
            # The reaper replaced this task's dispatch before it came here: nobody will send its KV.
            self.apply(self.core.void(seq))

    async def reject(self, delivery: Delivery, code: str, reason: str) -> None:
        """Dead-letter a task this worker cannot handle, and fail its request."""
        log.warning("task %s rejected: %s", delivery.entry_id, reason)
        await self.tasks.dead_letter(delivery, f"{code}: {reason}")
        request = getattr(delivery.message, "request", None)
        if isinstance(request, GenerateRequest):
            self.fail_request(request.request_id, f"{code}: {reason}", reader=request.reader)

    def fail_request(self, request_id: str, reason: str, *, reader: str) -> None:
        """End a request whose task was dead-lettered (``WorkerCore.fail_unheld``)."""
        self.apply(self.core.fail_unheld(request_id, reason, reader=reader))

    async def trim_tasks(self) -> None:
        """Delete this worker's task entries once acked (never an unacked one)."""
        await asyncio.sleep(TRIM_EVERY_S)
        await trim_tasks(self.redis, self.keys, self.id)


def _add(a: Reserved, b: Reserved) -> Reserved:
    return Reserved(
        a.reserved_prefill_tokens + b.reserved_prefill_tokens,
        a.reserved_requests + b.reserved_requests,
        a.reserved_kv_blocks + b.reserved_kv_blocks,
    )
