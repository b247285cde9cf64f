"""The engine's steps: a prefill of the queued requests, a decode of the running ones, and what
the worker tells schedulers about its load. A stepper (``splitbus.worker.stepper``) decides
which step runs when."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from splitbus import aio
from splitbus.bus.core.connection import is_transient, transient_suppressed
from splitbus.bus.core.streams import Delivery, GroupConsumer
from splitbus.bus.registry import Registry, WorkerLoad
from splitbus.worker import metrics
from splitbus.worker.publisher import Publisher
from splitbus.worker.requests import Status
from splitbus.worker.sequence import Sequence, kv_tokens
from splitbus.worker.shared import Shared

log = logging.getLogger(__name__)
WAIT_FOR_WORK_S = 0.5
WAIT_FOR_BLOCKS_S = 0.01
"""With requests queued but no KV blocks to prefill them into (and none running), the loop looks
again this often: a hand-off, a cancellation or an import may free blocks meanwhile."""
"""With nothing to step, the loop looks again this often (kv waits and deadlines to expire)."""
COUNTERS = (
    "prefills_done",
    "decodes_done",
    "steps",
    "idle_forwards",
    "step_time_us",
    "idle_time_us",
    "busy_time_us",
    "forward_ends_ms",
    "dp_epoch",
)
"""What the worker's load report carries from its steps: counters, and two DP values a rank sets
(``forward_ends_ms``, ``dp_epoch``; see ``WorkerLoad``)."""

EngineCall = Callable[[list[Sequence]], Awaitable[list[int]]]


class EngineSteps:
    """``expire`` ends what waited too long (kv waits, deadlines); ``settle`` runs after each
    engine call (a worker stopped during the step drops its moved requests before it writes for
    them); ``hand_off`` is the one-shot
    work started for each prefilled request of a prefill worker; ``cancel_peer`` tells a decode
    worker that its request finished at prefill."""

    def __init__(
        self,
        shared: Shared,
        publisher: Publisher,
        tasks: GroupConsumer,
        registry: Registry,
        *,
        expire: Callable[[], None],
        settle: Callable[[], Awaitable[None]],
        hand_off: Callable[[Sequence], Coroutine[Any, Any, None]],
        cancel_peer: Callable[[Sequence, str], None],
    ) -> None:
        self.config, self.id, self.engine, self.table = shared.config, shared.id, shared.engine, shared.table
        self.loops, self.wake = shared.loops, shared.wake
        self.publisher, self.tasks, self.registry = publisher, tasks, registry
        self.expire, self.settle, self.hand_off, self.cancel_peer = expire, settle, hand_off, cancel_peer
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.kv_blocked = False
        """The last prefill step found requests queued but no blocks to prefill any of them into."""

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            running=self.table.count(Status.RUNNING, Status.HANDING_OFF),
            waiting=self.table.count(Status.QUEUED, Status.AWAITING_KV),
            queued_prefill_tokens=sum(
                len(s.all_tokens) - max(s.cached, s.prompt_cached) for s in self.table.of(Status.QUEUED)
            ),
            free_kv_blocks=self.engine.free_blocks,
            total_kv_blocks=self.engine.total_blocks,
            **self.counters,
        )

    def has_work(self) -> bool:
        return bool(self.table.count(Status.RUNNING)) or (bool(self.table.count(Status.QUEUED)) and not self.kv_blocked)

    async def wait_for_work(self) -> None:
        self.expire()
        if self.has_work():
            return
        if self.kv_blocked:  # queued, no blocks to prefill into: look again once requests may have left
            await asyncio.sleep(WAIT_FOR_BLOCKS_S)
            self.kv_blocked = False
            return
        await aio.wait(self.wake, WAIT_FOR_WORK_S)
        self.wake.clear()

    def report_load_soon(self) -> None:
        """The engine took a prefill batch: report the load without it, which schedulers place
        the next work by while the batch runs. Until the next report the batch still counted as
        queued, so new work avoided the ranks that were prefilling most and piled onto the
        others, whose next prefill steps grew long (in the 4-rank benchmark, one rank
        prefilled up to 5 times as long as another in the same step)."""
        self.loops.spawn(self.report_load_now())

    async def report_load_now(self) -> None:
        """Advisory: an outage only leaves it to the next report."""
        with transient_suppressed("a load report"):
            await self.registry.report_load(self.id, self.load())

    async def prefill_queued(self, report_load: bool = True) -> None:
        """Prefill the next batch, then send each request on: RUNNING here (mixed), to its
        decode worker (prefill: a hand-off), or finished at its first token. ``report_load``:
        once the batch left the queue (a DP rank reports its load with each step instead).

        Called by the stepper once per turn: a worker on its own before each decode, a DP rank
        when the group's plans say this rank prefills. Redis refusing during it (the lease
        check after the engine call) leaves the batch QUEUED, first in line, for the next turn."""
        batch = self.table.start_prefill(self.config.max_prefill_tokens, self.engine.first_to_compute, self.allocate)
        self.kv_blocked = not batch and bool(self.table.count(Status.QUEUED))
        if not batch:
            return
        if report_load:
            self.report_load_soon()
        metrics.PROMPT_TOKENS.inc(sum(len(seq.all_tokens) for seq in batch))
        try:
            results = await self.run_engine(self.engine.prefill, batch)
            await self.settle()
        except BaseException:  # Redis refused (the loop waits it out): dropped here, the batch would be lost
            self.table.abort_prefill()
            raise
        still = self.table.end_prefill()
        results = [(seq, token) for seq, token in results if any(s is seq for s in still)]  # not moved away meanwhile
        metrics.GENERATION_TOKENS.inc(len(results))
        for seq, token in results:
            self.publisher.emit(seq, token)
            self.after_prefill(seq)

    def allocate(self, seq: Sequence) -> bool:
        """The blocks a queued request prefills into, taken as its prefill starts (with the
        prefix cache's blocks of its prompt as they are then); False: none yet, it waits."""
        return seq.blocks > 0 or self.engine.reserve(seq, kv_tokens(seq.task))

    def after_prefill(self, seq: Sequence) -> None:
        self.counters["prefills_done"] += 1
        if seq.task.phase == "mixed" and not seq.finished:
            self.table.add(seq, Status.RUNNING)
        elif seq.finished:  # done at its first token: D has nothing to decode
            self.publisher.finish(seq)
            if seq.task.phase == "prefill":
                self.cancel_peer(seq, "finished_on_prefill")
        else:
            self.table.add(seq, Status.HANDING_OFF)
            self.loops.spawn(self.hand_off(seq))

    async def decode_running(self) -> None:
        """One decode step for every RUNNING request: a token each, and the finished ones leave.

        Called by the stepper once per turn: a worker on its own after each prefill, a DP rank
        when the group's plans say this rank decodes. Requests that left during the engine call
        (cancelled, moved) get no token: only those still RUNNING after it are written for."""
        batch = self.table.of(Status.RUNNING)  # a snapshot: imports and cancellations change the table meanwhile
        if not batch:
            return
        results = await self.run_engine(self.engine.decode, batch)
        await self.settle()
        emitted = [(seq, token) for seq, token in results if self.table.holds(seq, Status.RUNNING)]
        metrics.GENERATION_TOKENS.inc(len(emitted))
        for seq, token in emitted:
            self.publisher.emit(seq, token)
        for seq in [s for s in self.table.of(Status.RUNNING) if s.finished]:
            self.table.remove(seq)
            self.counters["decodes_done"] += 1
            self.publisher.finish(seq)

    async def run_engine(self, step: EngineCall, batch: list[Sequence]) -> list[tuple[Sequence, int]]:
        """One engine call for the batch. If it raises, each sequence runs alone to find the
        one that breaks it: that request is poison and ends with an error and a dead letter,
        and the others go on."""
        try:
            with metrics.ENGINE_STEP.labels(getattr(step, "__name__", "step")).time():
                return list(zip(batch, await step(batch), strict=False))
        except Exception as exc:
            if is_transient(exc):
                raise
            log.error("engine step failed on a batch of %d (%s); running each alone", len(batch), exc)
        done = []
        for seq in batch:
            try:
                done += list(zip([seq], await step([seq]), strict=False))
            except Exception as exc:
                if is_transient(exc):
                    raise
                await self.poison(seq, exc)
        return done

    async def poison(self, seq: Sequence, exc: Exception) -> None:
        # The dead letter first: should it raise, the request is still held (prefilled or
        # decoded again later), not out of the table with nothing written for it.
        await self.tasks.dead_letter(Delivery(self.tasks.stream, seq.entry_id, seq.task), f"engine_error: {exc}")
        if self.table.remove(seq):  # else it left during the engine call (cancelled, moved)
            self.publisher.fail(seq, "engine_error", f"the engine failed on this request: {exc}", 500)
