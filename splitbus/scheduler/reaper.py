"""The reaper: when a worker's lease expires, its tasks move to live workers.

Runs in every scheduler replica; ``SET sb:reaping:{cell}:<worker> NX`` lets one of them take a dead
worker. For each task left in its stream (unread, or read and never acked):

- if the request's result stream has ended, or its hand-off id (``sb:current``) is no longer
  the task's (moved already) or is gone (the request ended), the task is simply acked;
- otherwise what was already sent (entries, and their tokens) is read from ``sb:out:{reader}:<id>``, and
  new tasks continue at the next ``seq`` from prompt + those tokens — a request that sent no
  token starts again, one mid-stream migrates, and the client's stream has no gap and no
  duplicate;
- a decode worker that still waits for that request's KV (its prefill worker died) is told to
  drop only that task (a scoped cancel), freeing its blocks;
- a request moved more than ``max_deliveries`` times fails with a clear error;
- a task of a prefill or decode DP group's rank that no worker can take now (no other complete
  group or single worker of the role) waits: it stays unacked, the dead rank is not marked dead,
  and the next pass tries again, until its group re-forms or the request's deadline passes (then
  a 503 ``worker_died`` saying so). A single worker's task fails at once, as before.

The dead worker then leaves the live set; its record (``state`` = dead), task and control
streams stay ``dead_worker_keep_s`` (an hour by default), then expire: nothing of it accumulates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import redis.asyncio as aioredis

from splitbus import tracing
from splitbus.bus.cancel import publish_cancel
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import is_transient
from splitbus.bus.core.streams import Delivery, GroupConsumer
from splitbus.bus.dispatch import PLACE_AGAIN, CurrentDispatch, DispatchOutcome
from splitbus.bus.messages import GenerateRequest, Task
from splitbus.bus.reaping import Reaping
from splitbus.bus.registry import Registry
from splitbus.bus.registry_view import RegistryView
from splitbus.bus.reservations import Reservations
from splitbus.bus.results import ResultWriter, Sent, read_sent
from splitbus.bus.roles import Phase, Role
from splitbus.bus.tasks import task_consumer
from splitbus.placement.decision import NoPlacement, Placement
from splitbus.placement.dispatcher import Dispatcher
from splitbus.placement.ledger import Local
from splitbus.placement.policies.base import Policy
from splitbus.scheduler import metrics, spans

log = logging.getLogger(__name__)


class Move(Enum):
    """What ``continue_request`` did with a dead worker's task that goes on."""

    MOVED = "moved"
    """New tasks are written on live workers (or the task was STALE, moved already: acked only)."""
    WAIT = "wait"
    """Nothing written: the next pass tries again (its DP group may re-form, or the chosen worker
    died too, or Redis is recovering)."""


@dataclass(frozen=True)
class Ended:
    """A dead worker's task whose request ends here."""

    finished: bool
    """True: it had sent every token it may (``max_tokens``): finished, reason ``length``."""
    reason: str = ""
    """Why it failed (its client's 503 says this); "" when finished."""


def _moved_label(outcome: Move | Ended) -> str:
    """``splitbus_scheduler_tasks_moved_total``'s outcome for a task that went on or ended."""
    if isinstance(outcome, Ended):
        return "finished" if outcome.finished else "failed"
    return "moved"


class Reaper:
    def __init__(
        self,
        redis: aioredis.Redis,
        config: BusConfig,
        name: str,
        view: RegistryView,
        policy: Policy,
        dispatcher: Dispatcher,
        local: Local,
    ) -> None:
        self.redis, self.config, self.name = redis, config, name
        self.keys = config.keys
        self.view, self.policy, self.dispatcher, self.local = view, policy, dispatcher, local
        self.registry = Registry(redis, config)
        self.reservations = Reservations(redis, config.keys)
        self.reaping = Reaping(redis, config.keys)
        self.current = CurrentDispatch(redis, config.keys)
        self.writer = ResultWriter(redis, config)

    async def reap_dead(self) -> None:
        """One pass over the dead workers (the scheduler runs it every ``reap_every_s``); a pass
        never ends on one worker's reap (the loop used to end, silently, on an OOM inside the
        result writer's script)."""
        suspects = [w.record.worker_id for w in self.view.workers if not w.alive]
        if not suspects:
            return
        held = await self.registry.leases(suspects)  # the view may lag (a stop, an outage): Redis decides
        for worker_id, lease in zip(suspects, held, strict=True):
            if not lease:
                await self.reap_safely(worker_id)

    async def reap_safely(self, worker_id: str) -> None:
        """Redis refusing (unreachable, OOM, LOADING...) or any other failure is logged and the
        pass goes on to the next worker; this one is tried again once its ``sb:reaping`` mark
        expires."""
        try:
            await self.reap(worker_id)
        except Exception as exc:
            if is_transient(exc):
                log.warning("reaping %s waits: Redis refuses or is unreachable (%s)", worker_id, exc)
                return
            log.exception("reaping %s failed; it is tried again later", worker_id)

    async def reap(self, worker_id: str) -> int:
        """Move every task of a dead worker; returns how many there were (0 if another replica
        is on it)."""
        if not await self.reaping.take(worker_id, self.name):
            return 0
        stream = task_consumer(self.redis, self.config, worker_id, f"reaper.{self.name}")
        await stream.ensure_group()
        read = await stream.read(100_000, block_ms=0) + await stream.claim_idle(100_000, min_idle_ms=0)
        tasks = list({d.entry_id: d for d in read}.values())  # what it read, claimed again too: once
        waiting = [d for d in tasks if not await self.move(worker_id, stream, d)]
        await self.writer.flush()
        if waiting:  # the next pass takes the worker again, for these alone (the rest are acked)
            await stream.kept_waiting(*[d.entry_id for d in waiting])
            await self.reaping.release(worker_id)
            log.warning(
                "worker %s is dead: %d task(s) wait for the next pass (for its DP group to re-form, or for a live "
                "worker: the one chosen had gone too, or Redis is recovering)",
                worker_id,
                len(waiting),
            )
            return len(tasks) - len(waiting)
        await self.registry.mark_dead(worker_id)
        log.warning("worker %s is dead: moved %d task(s)", worker_id, len(tasks))
        return len(tasks)

    async def move(self, dead: str, stream: GroupConsumer, delivery: Delivery) -> bool:
        """Move, finish or fail one task of the dead worker; False if it waits for its group."""
        task = delivery.message
        if not isinstance(task, Task):
            await stream.ack(delivery.entry_id)
            return True
        request = task.request
        sent = await read_sent(self.redis, self.config, request.reader, request.request_id)
        if sent.ended or await self.superseded(task):
            log.debug(
                "task %s of %s on %s: %s; acked only",
                delivery.entry_id,
                request.request_id,
                dead,
                "ended" if sent.ended else "its dispatch was replaced, or it ended",
            )
            await stream.ack(delivery.entry_id)
            metrics.TASKS_MOVED.labels("acked").inc()  # once acked: a failed ack is retried, and counted, next pass
            return True
        if task.phase == Phase.PREFILL:
            await self.release_decode_side(task)
        outcome = await self.continue_request(dead, delivery, task, sent)
        if outcome is Move.WAIT:
            return False
        if isinstance(outcome, Ended):
            await self.end(stream, delivery.entry_id, task, sent, outcome)
        else:
            metrics.TASKS_MOVED.labels(_moved_label(outcome)).inc()  # the dispatch that moved it acked it
        return True

    async def end(self, stream: GroupConsumer, entry_id: str, task: Task, sent: Sent, ended: Ended) -> None:
        """Ack the task of a request that ends here, count it once acked (a failed ack is retried,
        and counted, at the next pass), then fail or finish the request."""
        await stream.ack(entry_id)
        metrics.TASKS_MOVED.labels(_moved_label(ended)).inc()
        if ended.finished or not await self.superseded(task):  # else it lives on elsewhere
            self.fail_or_finish(task.request, sent, ended)

    async def continue_request(self, dead: str, delivery: Delivery, task: Task, sent: Sent) -> Move | Ended:
        """Write the new tasks (``Move.MOVED``), keep the task for the next pass (``Move.WAIT``),
        or say why the request ends here."""
        request = task.request
        finished = len(sent.tokens) >= request.sampling.max_tokens
        decision = self.policy.place(request, self.view.workers, self.local)
        if isinstance(decision, NoPlacement) and not finished and self.group_may_reform(dead, request.deadline_ms):
            return Move.WAIT  # not a move yet: a wait counts none
        moves = await self.reaping.count_move(request.request_id)
        if moves > self.config.max_deliveries:
            return Ended(False, f"the request failed on {moves} workers")
        if finished:
            return Ended(True)
        if isinstance(decision, NoPlacement):
            return Ended(False, self.no_placement(dead, decision.reason))
        placement = decision.placements
        # STALE (moved meanwhile by another reaper, off the task's other worker) is acked only
        outcome = await self.redispatch(dead, delivery, task, placement, sent)
        if outcome in PLACE_AGAIN:  # a new Redis run, or the new worker died: nothing was written;
            return Move.WAIT  # the next pass moves it
        log.debug(
            "moved task %s of %s off %s to %s: outcome %d",
            delivery.entry_id,
            request.request_id,
            dead,
            [p.worker.record.worker_id for p in placement],
            outcome,
        )
        return Move.MOVED

    async def redispatch(
        self, dead: str, delivery: Delivery, task: Task, placement: Sequence[Placement], sent: Sent
    ) -> DispatchOutcome:
        """The move's write, in its ``scheduler.move`` span (ended failed if the write raises)."""
        span = spans.move(task, dead) if tracing.on else None
        try:
            outcome = await self.dispatcher.redispatch(
                dead, delivery.entry_id, task, placement, sent.next_seq, sent.tokens, tracing.traceparent(span)
            )
        except BaseException as exc:  # Redis refused, a bug: the span must end all the same
            spans.not_moved(span, exc)
            raise
        spans.moved(span, outcome)
        return outcome

    def group_may_reform(self, dead: str, deadline_ms: int) -> bool:
        """Whether a task of ``dead`` with nothing to take it should wait: ``dead`` was a rank of
        a prefill or decode DP group (``splitbus up`` restarts its ranks, and the group comes back
        complete), and the request's deadline has not passed. A request with no deadline (0: a
        bus-level client's) does not wait: nothing would bound it."""
        return self.pd_group_rank(dead) and time.time() * 1000 < deadline_ms

    def pd_group_rank(self, worker_id: str) -> bool:
        """Whether the worker was a rank of a prefill or decode DP group (a mixed group's ranks
        fail what they hold when it breaks: nothing of theirs waits)."""
        record = next((w.record for w in self.view.workers if w.record.worker_id == worker_id), None)
        return record is not None and record.dp_size > 0 and record.role in (Role.PREFILL, Role.DECODE)

    def no_placement(self, dead: str, reason: str) -> str:
        """Why a task of ``dead`` ends unplaced; for a rank of a broken group, that it waited."""
        if self.pd_group_rank(dead):
            return f"worker {dead} died, its DP group did not re-form before the request's deadline, and {reason}"
        return f"worker {dead} died and {reason}"

    async def superseded(self, task: Task) -> bool:
        """The task's dispatch is no longer its request's current one: the request was moved
        already (its other worker died first: a decode task whose prefill worker's death
        released it, but which its dead worker never dropped), or it is over (no current one:
        the API deleted it with the final entry, which its stream may no longer show once its
        grace passed). Moving it would give the request two live dispatches, or run a finished
        one again from the start. The dispatch script checks this again, atomically."""
        if not task.handoff:  # written before hand-off ids: nothing to compare
            return False
        return await self.current.read(task.request.request_id) != task.handoff.encode()

    def fail_or_finish(self, request: GenerateRequest, sent: Sent, ended: Ended) -> None:
        request_id = request.request_id
        self.writer.open(request_id, reader=request.reader, first_seq=sent.next_seq)
        if ended.finished:
            self.writer.finish(request_id, "length", 0, len(sent.tokens))
        else:
            self.writer.fail(request_id, "worker_died", ended.reason, 503, reader=request.reader)

    async def release_decode_side(self, task: Task) -> None:
        """The decode worker waiting for this prefill task's KV will not get it: free its task
        (the reservation of this dispatch only: a newer one's decode side is the request's now)."""
        request_id = task.request.request_id
        reservation = await self.reservations.read(request_id)
        if reservation is not None and reservation.handoff == task.handoff:
            worker, entry = reservation.decode_worker, reservation.task_entry
            await publish_cancel(self.redis, self.config, request_id, "moved", worker, entry)
