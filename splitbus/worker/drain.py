"""Draining: a worker leaving on purpose (SIGTERM with ``--drain-timeout``) takes no new task,
finishes what it holds, then leaves the registry and exits 0.

Order matters. The core's flag goes first (every load it reports from then on says draining), then
the flag is written to the worker's hash: from that write on the dispatch script writes no task for
it (``DispatchOutcome.WORKER_DRAINING``), and placements skip it once their registry view shows it
(``WorkerInfo.placeable``). Every loop keeps running meanwhile, so the task feed reads the tasks
written before the flag. The worker is drained when its hash holds the flag, it holds no request
(a prefill's hand-off in flight counts), every entry of its task stream is read and acked (a task
read but not yet taken into the table is neither held nor unread: only its missing ack tells)
and its outbox has written everything (the acks included). Past the timeout it stops with work
left: it gives its lease up (``Registry.resign``) and the reaper moves each request mid-stream to
another worker. Only a drain that saw all of that leaves the registry (``Drain.finished``): one
that holds nothing but has a task unread or unacked, a result unwritten, or the flag not shown
resigns too, as a task read and not taken would be lost with a deregistered worker (the reaper
never looks at one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from splitbus.bus.core.connection import is_transient
from splitbus.bus.core.loops import Loops
from splitbus.worker.core import WorkerCore

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_S = 0.1
"""How often a draining worker checks whether it is done."""


class Drain:
    """One worker's drain. ``flag`` says whether its hash shows the flag, writing its load (the flag
    in it) again when it does not; ``unsettled`` counts its task stream's entries not read or not
    acked; ``unwritten`` counts what its outbox has not written yet."""

    def __init__(
        self,
        core: WorkerCore,
        loops: Loops,
        flag: Callable[[], Awaitable[bool]],
        unsettled: Callable[[], Awaitable[int]],
        unwritten: Callable[[], int],
    ) -> None:
        self.core, self.loops = core, loops
        self.flag, self.unsettled, self.unwritten = flag, unsettled, unwritten
        self.started = False
        self.finished = False
        """Whether ``drained`` ever said True: only then may the worker leave the registry."""

    @property
    def unfinished(self) -> bool:
        """A drain began and never saw the worker drained: it must resign, not deregister."""
        return self.started and not self.finished

    def begin(self, timeout_s: float) -> bool:
        """Start the drain in the background (a signal handler's call, or a control command's);
        False, and nothing done, once a drain has begun or the worker stops."""
        if self.started or self.loops.stopped:
            return False
        self.started = True
        self.loops.spawn(self.run(timeout_s))
        return True

    async def run(self, timeout_s: float) -> None:
        """Drain for up to ``timeout_s``, then stop the worker: drained or not, it leaves."""
        self.started = self.core.draining = True
        tasks = await self.guarded(self.unsettled, -1)
        log.info(
            "worker %s draining: no new task; up to %.1f s to finish %d requests and %d tasks not yet done",
            self.core.id,
            timeout_s,
            self.core.held(),
            tasks,  # -1: Redis did not say
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.loops.stopped and loop.time() < deadline:
            if await self.drained():
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.loops.stopping.wait(), POLL_S)
        await self.say_end(timeout_s, loop.time() >= deadline)
        self.loops.stop()

    async def say_end(self, timeout_s: float, bound_passed: bool) -> None:
        """The end of the drain, in the log: drained, or what it left for the reaper."""
        held = self.core.held()
        if self.finished:
            log.info("worker %s drained: leaving the registry", self.core.id)
        elif held and bound_passed:
            log.warning("drained: %d requests handed over by migration after %.1f s", held, timeout_s)
        elif held:  # stopped before the bound (SIGINT, a failed loop): the stop says what follows
            log.info("worker %s stopped while draining, holding %d requests", self.core.id, held)
        else:
            when = f"after {timeout_s:.1f} s" if bound_passed else "(stopped before its bound)"
            log.warning(
                "worker %s not drained %s: %s; it resigns, for the reaper to move what is left",
                self.core.id,
                when,
                await self.left(),
            )

    async def drained(self) -> bool:
        """Whether nothing is left to do: the flag is in the hash (no task can come after; read back
        every poll, as a beat built before the flag may write 0 after it), nothing is held,
        unwritten, unread or unacked. Redis refusing for now: not yet."""
        if not await self.guarded(self.flag, False) or self.core.held() or self.unwritten():
            return False
        if await self.guarded(self.unsettled, 1) != 0:
            return False
        self.finished = True
        return True

    async def left(self) -> str:
        """What keeps the worker from being drained, read once more, for the log (no request held)."""
        parts = [] if await self.guarded(self.flag, False) else ["the flag not shown in its hash"]
        if unwritten := self.unwritten():
            parts.append(f"{unwritten} results unwritten")
        unsettled = await self.guarded(self.unsettled, -1)
        if unsettled:  # -1: Redis did not say
            parts.append(f"{unsettled} tasks unread or unacked" if unsettled > 0 else "tasks unknown (Redis refused)")
        return ", ".join(parts) or "nothing any more"

    @staticmethod
    async def guarded(read: Callable[[], Awaitable[T]], otherwise: T) -> T:
        """``read()``, or ``otherwise`` while Redis refuses or is unreachable (logged)."""
        try:
            return await read()
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("drain: Redis refuses or is unreachable (%s); retrying", exc)
            return otherwise
