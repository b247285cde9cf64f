"""The engine's steps, the shell's side: each step is the core's plan, the engine call awaited,
then the core's postprocess, whose effects are applied at once (``splitbus.worker.core``).

What runs the steps is the worker's stepper, which decides when it prefills, decodes or waits:
``SoloStepper`` is a worker on its own; ``splitbus.worker.dp.DpStepper`` is one rank of a DP
group, which steps with the other ranks (the barrier is the stepper's; what a rank runs in a
step is these steps)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from splitbus import aio, tracing
from splitbus.bus.core import hopmarks
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import is_transient
from splitbus.bus.core.loops import Loops
from splitbus.bus.core.streams import Delivery, GroupConsumer
from splitbus.bus.registry import Registry
from splitbus.worker import metrics, spans
from splitbus.worker.core import WorkerCore
from splitbus.worker.outbox import Outbox
from splitbus.worker.sequence import Sequence

log = logging.getLogger(__name__)
WAIT_FOR_WORK_S = 0.5
"""With nothing to step, the loop looks again this often (kv waits and deadlines to expire)."""
WAIT_FOR_BLOCKS_S = 0.01
"""With requests queued but no KV blocks to prefill them into (and none running), the loop looks
again this often: a hand-off, a cancellation or an import may free blocks meanwhile."""

EngineCall = Callable[[list[Sequence]], Awaitable[list[int]]]


def _mark(batch: list[Sequence], name: str) -> None:
    """Hop marks (``splitbus.bus.core.hopmarks``), when on: ``name`` for each request of the
    batch (a call a batch when off, not a branch in each caller: the step's own stay readable)."""
    if hopmarks.on:
        for seq in batch:
            hopmarks.mark(seq.request_id, name)


def _us(seconds: float) -> int:
    return round(seconds * 1e6)


class DecodeClock:
    """``decode_time_us``: each decode step counts its time to the next step's start, prefills run
    in between included (what a request sees between two tokens); the last step of a busy spell,
    with none after it, counts to its own end. So the time over ``decode_steps`` is the mean ITL."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters
        self.started: float | None = None
        """When the step that has not been counted yet began (None: no decode since the last idle)."""
        self.ended = 0.0

    def step_starts(self, now: float) -> None:
        if self.started is not None:
            self.counters["decode_time_us"] += _us(now - self.started)
        self.started = now

    def step_ends(self, now: float, tokens: int) -> None:
        self.ended = now
        self.counters["decode_steps"] += 1
        self.counters["decode_tokens_done"] += tokens

    def idle(self) -> None:
        """Nothing is running: the last step counts to its end, and the next spell starts afresh."""
        if self.started is not None:
            self.counters["decode_time_us"] += _us(max(self.ended - self.started, 0.0))
            self.started = None


class CollectiveFailed(Exception):
    """An engine call of a rank with expert parallelism raised: its group's other ranks are inside
    the same collective, so the group is broken (the call is not retried per request)."""


class EngineSteps:
    """The core's effects go to ``outbox``; ``expire_waits`` ends the kv waits that ran out
    (``Receiver.expire_waits``); ``settle`` runs after each engine call (a worker stopped during
    the step drops its moved requests before it writes for them: ``Lease.settle_if_lapsed``)."""

    def __init__(
        self,
        core: WorkerCore,
        outbox: Outbox,
        tasks: GroupConsumer,
        registry: Registry,
        loops: Loops,
        *,
        expire_waits: Callable[[], None],
        settle: Callable[[], Awaitable[None]],
    ) -> None:
        self.core, self.engine, self.id, self.outbox = core, core.engine, core.id, outbox
        self.tasks, self.registry, self.loops = tasks, registry, loops
        self.apply, self.expire_waits, self.settle = outbox.apply, expire_waits, settle
        self.wake = outbox.wake
        """Set when the engine loop has something new to do (work came, a request left)."""
        self.decode_clock = DecodeClock(core.counters)
        self.collective = False
        """Every engine call is a collective of a group (expert parallelism; the DP stepper sets
        it): one that raises breaks the group (``CollectiveFailed``) instead of being run again
        for each request, which the other ranks would not join."""

    def expire(self) -> None:
        """What waited too long ends: deadlines passed (the core's), kv waits that ran out (the
        receiver's, which looks at Redis first)."""
        self.apply(self.core.deadlines_past())
        self.expire_waits()

    @property
    def counters(self) -> dict[str, int]:
        return self.core.counters

    def has_work(self) -> bool:
        return self.core.has_work()

    async def wait_for_work(self) -> None:
        self.expire()
        if self.core.has_work():
            return
        if self.core.kv_blocked:  # queued, no blocks to prefill into: look again once requests may have left
            await asyncio.sleep(WAIT_FOR_BLOCKS_S)
            self.core.look_for_blocks_again()
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
        # transient_suppressed's rule, written out: a call into bus/core/connection.py from here
        # would be a call back into the module whose loop runner (``forever``) runs this step.
        try:
            await self.registry.report_load(self.id, self.core.load())
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("a load report skipped: Redis refuses or is unreachable (%s)", exc)

    async def prefill_queued(self, report_load: bool = True) -> bool:
        """Prefill the next batch (``WorkerCore.plan_prefill``, the engine call, ``end_prefill``).
        ``report_load``: once the batch left the queue (a DP rank reports its load with each
        step instead).

        Called by the stepper once per turn: a worker on its own before each decode, a DP rank
        when the group's plans say this rank prefills. Redis refusing during it (the lease
        check after the engine call) leaves the batch QUEUED, first in line within its priority, for the next turn.
        Returns whether it ran an engine call (False: nothing to prefill, or no blocks for it)."""
        batch = self.core.plan_prefill()
        if not batch:
            return False
        if report_load:
            self.report_load_soon()
        metrics.PROMPT_TOKENS.inc(sum(len(seq.all_tokens) for seq in batch))
        if tracing.on:
            spans.prefill_started(batch)
        counters, started = self.core.counters, time.perf_counter()
        _mark(batch, "worker.prefill")
        try:
            results = await self.run_engine(self.engine.prefill, batch)
            counters["prefill_busy_us"] += _us(time.perf_counter() - started)
            _mark(batch, "worker.prefilled")
            await self.settle()
        except BaseException as exc:  # Redis refused (the loop waits it out): dropped here, the batch would be lost
            self.core.abort_prefill()
            if tracing.on:
                spans.prefill_failed(batch, exc)
            raise
        cached = counters["prompt_tokens_cached"]
        self.apply(self.core.end_prefill(results))
        _mark(batch, "worker.token")
        metrics.PROMPT_CACHED_TOKENS.inc(counters["prompt_tokens_cached"] - cached)
        if tracing.on:
            spans.prefill_ended(batch)
        return True

    async def decode_running(self) -> bool:
        """One decode step for every RUNNING request (``plan_decode``, the engine call,
        ``end_decode``).

        Called by the stepper once per turn: a worker on its own after each prefill, a DP rank
        when the group's plans say this rank decodes. Returns whether it ran an engine call."""
        batch = self.core.plan_decode()
        if not batch:
            self.decode_clock.idle()
            return False
        if tracing.on:
            spans.decoding(batch)
        self.decode_clock.step_starts(time.perf_counter())
        self._mark_next(batch, "tok.engine")
        results = await self.run_engine(self.engine.decode, batch)
        self.decode_clock.step_ends(time.perf_counter(), len(results))
        self._mark_next(batch, "tok.engined")
        await self.settle()
        self.apply(self.core.end_decode(results))
        if tracing.on:
            spans.decoded(batch, self.core.table)
        return True

    def _mark_next(self, batch: list[Sequence], name: str) -> None:
        """Hop marks, when on: ``name`` for the entry each request of the batch writes next (the
        token path's marks: ``hop_trace``'s token table)."""
        if hopmarks.on:
            self.outbox.writer.mark_next((seq.request_id for seq in batch), name)

    async def run_engine(self, step: EngineCall, batch: list[Sequence]) -> list[tuple[Sequence, int]]:
        """One engine call for the batch. If it raises, each sequence runs alone to find the
        one that breaks it: that request is poison and ends with an error and a dead letter,
        and the others go on."""
        try:
            with metrics.ENGINE_STEP.labels(getattr(step, "__name__", "step")).time():
                return list(zip(batch, await step(batch), strict=False))
        except Exception as exc:
            if self.collective:  # before is_transient: an engine touches no Redis, and NCCL raises OSError
                raise CollectiveFailed(f"an engine step of a batch of {len(batch)} failed: {exc}") from exc
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
        letter = self.core.poison_letter(seq, exc)
        await self.tasks.dead_letter(Delivery(self.tasks.stream, letter.entry_id, letter.task), letter.reason)
        self.apply(self.core.poisoned(seq, exc))


class RankConfig(Protocol):
    """What a stepper reads of the worker's config (``WorkerConfig`` has it)."""

    @property
    def bus(self) -> BusConfig: ...
    @property
    def worker_id(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def dp_group(self) -> str: ...
    @property
    def dp_rank(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def dp_align_ms(self) -> float: ...
    @property
    def dp_barrier_timeout_s(self) -> float: ...
    @property
    def ep(self) -> bool: ...
    @property
    def ep_timeout_s(self) -> float: ...
    @property
    def transfer_host(self) -> str: ...
    @property
    def advertised_transfer_host(self) -> str: ...


@dataclass(frozen=True)
class StepParts:
    """The parts of a worker a stepper works with."""

    config: RankConfig
    redis: aioredis.Redis
    registry: Registry
    steps: EngineSteps
    """The engine's steps, and through them the core (its table, its load)."""
    outbox: Outbox
    """The publisher is asked for a write after each step (``soon``): the step's tokens go out."""
    publish: Callable[[], Awaitable[None]]
    """Write now (what a broken group's rank leaves: ``Publisher.publish``)."""
    loops: Loops
    """The worker's loops: one-shot work is spawned there; a stepper that stops the worker stops them."""


class Stepper(Protocol):
    async def start(self) -> None:
        """Called once, after the worker has joined the bus and before its first step."""

    async def step(self) -> None:
        """Called by the engine loop until the worker stops: one turn (a wait for work, or a step)."""

    async def work_arrived(self) -> None:
        """Called once the task feed has taken tasks: the engine loop has work."""


StepperFactory = Callable[[StepParts], Stepper]
"""How a worker is given its stepper: called with the worker's parts once they exist."""


class SoloStepper:
    """A worker on its own: prefill what is queued, then decode what runs; results go out after
    each engine call, written by the publisher while the engine goes on (a first token waits
    neither for the decode nor for Redis)."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts

    async def start(self) -> None:
        pass

    async def step(self) -> None:
        p = self.parts
        await p.steps.settle()  # back from a stop: what moved away is dropped before anything
        await p.steps.wait_for_work()
        await p.steps.prefill_queued()
        p.outbox.soon()
        await p.steps.decode_running()
        p.outbox.soon()

    async def work_arrived(self) -> None:
        self.parts.steps.wake.set()
