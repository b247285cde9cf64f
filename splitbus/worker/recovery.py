"""What a worker re-publishes once Redis has a new server run (a restart from its AOF, a failover
to a replica): the run keeps a prefix of what was written, so the latest writes this worker made
or depends on may be gone (docs/reliability.md, "What a worker re-publishes after a new Redis
run"). Each heartbeat polls the runs (``splitbus.bus.runs``); after a new one, under the publish
lock, in order: the record and the task group; every held task's dispatch (``sb:current``); the
KV reservations of decode tasks still waiting; the peer's task of a dispatch whose tasks are gone;
the result entries of the replay window; the tasks pending to this worker that it never saw.
Every step is idempotent: a Redis error leaves the recovery owed, and the next beat runs it all
again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.streams import GroupConsumer
from splitbus.bus.dispatch import Reassertion, ReassertOutcome
from splitbus.bus.messages import Task
from splitbus.bus.reservations import Reservations
from splitbus.bus.results import ResultWriter
from splitbus.bus.roles import Phase
from splitbus.bus.runs import Runs, ServerRuns
from splitbus.bus.tasks import missing_entries, send_task
from splitbus.worker.core import WorkerCore
from splitbus.worker.effects import Apply
from splitbus.worker.outbox import NewRun
from splitbus.worker.sequence import Sequence
from splitbus.worker.table import Status

log = logging.getLogger(__name__)

BEFORE_HANDOFF = {
    Phase.PREFILL: (Status.QUEUED, Status.PREFILLING, Status.HANDING_OFF),
    Phase.DECODE: (Status.AWAITING_KV,),
}
"""The statuses in which a task's peer may still need its own task: P has not shipped the KV
(or is shipping it), D has not had it."""
PEER_PHASE = {Phase.PREFILL: Phase.DECODE, Phase.DECODE: Phase.PREFILL}


@dataclass(frozen=True)
class Recovered:
    """What one recovery re-published (the WARNING it logs)."""

    dispatches: int
    """Held tasks whose dispatch is current again (written again or still there)."""
    dropped: int
    """Held tasks dropped: their request was dispatched again meanwhile."""
    reservations: int
    """KV reservations written again."""
    peer_tasks: int
    """Peers' tasks sent again."""
    results: int
    """Result entries written again (``results_lost`` errors included)."""


class Recovery:
    """``watch`` records a new run (at start-up and before every beat); ``recover_if_owed`` runs
    after every beat. ``beat`` writes the worker's record; ``take_lost`` is the task feed's."""

    def __init__(
        self,
        core: WorkerCore,
        redis: aioredis.Redis,
        bus: BusConfig,
        tasks: GroupConsumer,
        writer: ResultWriter,
        *,
        apply: Apply,
        beat: Callable[[], Awaitable[None]],
        take_lost: Callable[[], Awaitable[None]],
        lock: asyncio.Lock,
        new_run: NewRun,
    ) -> None:
        self.core, self.id, self.redis, self.bus, self.keys = core, core.id, redis, bus, bus.keys
        self.table, self.tasks, self.writer, self.apply = core.table, tasks, writer, apply
        self.beat, self.take_lost, self.lock = beat, take_lost, lock
        self.reservations = Reservations(redis, bus.keys)
        self.runs = ServerRuns(self.redis, f"worker {self.id}")
        self.reassertion = Reassertion(self.redis, self.keys)
        self.new_run = new_run
        """A new run was seen and its recovery has not completed yet (``owed``; the task feed reads it)."""

    async def watch(self) -> bool:
        """Poll the runs; whether Redis has a new one (its recovery is owed from now on)."""
        if await self.runs.poll() is Runs.NEW:
            self.new_run.owed = True
            return True
        return False

    async def recover_if_owed(self) -> None:
        if self.new_run.owed:
            async with self.lock:  # nothing is written for a request until its dispatch is settled
                done = await self.recover()
            self.new_run.owed = False
            log.warning(
                "worker %s: after a new Redis run, re-published %d dispatch(es) (%d dropped: dispatched again),"
                " %d KV reservation(s), %d peer task(s), %d result entr(ies)",
                self.id,
                done.dispatches,
                done.dropped,
                done.reservations,
                done.peer_tasks,
                done.results,
            )

    async def recover(self) -> Recovered:
        """The whole recovery, in order (each step safe to repeat)."""
        await self.beat()  # the whole record, as every beat
        await self.tasks.ensure_group()
        kept, dropped = await self.reassert_dispatches()
        reservations = await self.reserve_again()
        peer_tasks = await self.send_peer_tasks()
        results = await self.writer.replay()
        await self.take_lost()
        return Recovered(kept, dropped, reservations, peer_tasks, results)

    async def reassert_dispatches(self) -> tuple[int, int]:
        """Each held task's dispatch made current again; a task whose request another dispatch
        has now is dropped, as one the reaper moved. (Kept, dropped.)"""
        kept = dropped = 0
        for seq in self.table.of():
            if not seq.task.handoff:  # from before hand-off ids: nothing to assert
                continue
            answer = await self.reassertion.reassert(seq.request_id, seq.task.handoff, seq.request.deadline_ms)
            if answer is ReassertOutcome.SUPERSEDED:
                if self.table.status(seq) is not None:
                    log.info("task %s of %s: dispatched again meanwhile; dropped", seq.entry_id, seq.request_id)
                    self.apply(self.core.moved_away(seq))
                    dropped += 1
            else:
                kept += 1
        return kept, dropped

    async def reserve_again(self) -> int:
        """The KV reservations of the tasks still waiting for their KV, written again where the
        run lost them (the same secret: a frame P sends for the old one is still taken)."""
        written = 0
        for seq in self.table.of(Status.AWAITING_KV):
            if await self.reservations.read(seq.request_id) is not None:
                continue
            if self.table.holds(seq, Status.AWAITING_KV):  # its KV came, or it left, during the read
                written += await self.reservations.reserve(seq.request_id, self.core.reservation_of(seq))
        return written

    async def send_peer_tasks(self) -> int:
        """A held task whose own entry the run lost was dispatched with its peer's, lost with it:
        if the peer had not read its task, it never will, and this side waits in vain. So each
        side sends the other its task again (the same hand-off id, nothing reserved); a peer that
        holds the request already acks the copy."""
        waiting = [s for s in self.table.of() if self.table.status(s) in BEFORE_HANDOFF.get(Phase(s.task.phase), ())]
        lost = await missing_entries(self.redis, self.keys, self.id, [s.entry_id for s in waiting])
        sent = 0
        for seq in waiting:
            if seq.entry_id in lost and self.table.status(seq) is not None:
                await send_task(self.redis, self.bus, seq.task.peer, self.peer_task(seq))
                sent += 1
        return sent

    def peer_task(self, seq: Sequence) -> Task:
        task = seq.task
        return Task(
            PEER_PHASE[Phase(task.phase)],
            task.request,
            self.id,
            task.first_seq,
            list(task.output_token_ids),
            handoff=task.handoff,
        )
