"""Draining: a worker leaving on purpose (SIGTERM with ``--drain-timeout``) takes no new task,
finishes what it holds, then leaves the registry and exits 0.

Order matters. The core's flag goes first (every load it reports from then on says draining), then
the flag is written to the worker's hash: from that write on the dispatch script writes no task for
it (``DispatchOutcome.WORKER_DRAINING``), and placements skip it once their registry view shows it
(``WorkerInfo.placeable``). Every loop keeps running meanwhile, so the task feed reads the tasks
written before the flag. The worker is drained when its hash holds the flag, it holds no request
(a prefill's hand-off in flight counts), its task stream holds no unread entry and its outbox
has written everything. Past the timeout it stops with work held: it gives its lease up
(``Registry.resign``) and the reaper moves each request mid-stream to another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from splitbus.bus.core.connection import is_transient
from splitbus.bus.core.loops import Loops
from splitbus.worker.core import WorkerCore

log = logging.getLogger(__name__)

POLL_S = 0.1
"""How often a draining worker checks whether it is done."""


class Drain:
    """One worker's drain. ``flag`` writes its load (the flag in it) to its hash; ``unread`` counts
    its task stream's unread entries; ``unwritten`` counts what its outbox has not written yet."""

    def __init__(
        self,
        core: WorkerCore,
        loops: Loops,
        flag: Callable[[], Awaitable[object]],
        unread: Callable[[], Awaitable[int]],
        unwritten: Callable[[], int],
    ) -> None:
        self.core, self.loops = core, loops
        self.flag, self.unread, self.unwritten = flag, unread, unwritten
        self.started = False
        self._flagged = False

    def begin(self, timeout_s: float) -> None:
        """Start the drain in the background (a signal handler's call; a second one does nothing)."""
        if self.started or self.loops.stopped:
            return
        self.started = True
        self.loops.spawn(self.run(timeout_s))

    async def run(self, timeout_s: float) -> None:
        """Drain for up to ``timeout_s``, then stop the worker: drained or not, it leaves."""
        self.core.draining = True
        log.info(
            "worker %s draining: no new task; up to %.1f s to finish %d requests",
            self.core.id,
            timeout_s,
            self.core.held(),
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.loops.stopped and loop.time() < deadline:
            if await self.drained():
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.loops.stopping.wait(), POLL_S)
        if held := self.core.held():
            log.warning("drained: %d requests handed over by migration after %.1f s", held, timeout_s)
        else:
            log.info("worker %s drained: leaving the registry", self.core.id)
        self.loops.stop()

    async def drained(self) -> bool:
        """Whether nothing is left to do: the flag is in the hash (no task can come after), nothing
        is held, unread or unwritten. Redis refusing for now: not yet."""
        try:
            if not self._flagged:
                await self.flag()
                self._flagged = True
            return not self.core.held() and not self.unwritten() and not await self.unread()
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.warning("drain: Redis refuses or is unreachable (%s); retrying", exc)
            return False
