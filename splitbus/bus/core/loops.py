"""One way to run a process's background loops: the API's, a scheduler's and a worker's.

Every long-running part keeps a few loops besides its main one (a heartbeat, a registry refresh,
a reaper pass) and one-shot work it does not wait for (a hand-off, a cancel notice). They all run
under :class:`Loops`, with one error policy (``forever``'s, as arq's ``poll()``): a transient Redis
error is waited out with backoff; anything else is a bug in the loop, which is logged with its
traceback and stops the process with ``EXIT_FATAL`` for its supervisor to restart. No loop ends
silently, and no loop outlives ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from splitbus.bus.core.aio import cancel_and_wait
from splitbus.bus.core.connection import forever

log = logging.getLogger(__name__)

EXIT_FATAL = 1
"""The exit code of a process stopped by a loop's bug (0 is a clean stop, which supervisors do
not restart)."""

Step = Callable[[], Awaitable[object]]


class Loops:
    """The background loops of one process: ``owner`` names it in logs (``worker p1``), ``part``
    says what a loop's failure stops (``the worker``).

    ``start(step)`` is called once per loop at start-up; ``spawn(work)`` whenever one-shot work
    must run in the background; ``stop()`` when the process stops for any reason, and ``close()``
    on its way out. ``stopping`` is set by ``stop()`` and by a loop's failure; the part waits on
    it (or checks ``stopped``) and reads ``exit_code`` when it ends. ``on_fail`` is called once a
    loop has failed: it wakes what the part itself waits on, or stops a server it does not own.
    """

    def __init__(self, owner: str, *, part: str = "the process", on_fail: Callable[[], None] = lambda: None) -> None:
        self.owner, self.part = owner, part
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self._on_fail = on_fail
        self._tasks: dict[asyncio.Task[Any], None] = {}  # every task still running, in start order
        self._loops: set[asyncio.Task[Any]] = set()  # those of them that are loops (``start``)

    @property
    def stopped(self) -> bool:
        return self.stopping.is_set()

    def start(self, step: Step, *, every_s: float = 0.0, name: str | None = None) -> None:
        """Run ``step`` until the process stops, ``every_s`` apart (0: again at once; a step that
        blocks on Redis sets its own pace)."""
        task = asyncio.create_task(self.run(step, every_s=every_s, name=name))
        self._loops.add(task)
        task.add_done_callback(self._loops.discard)
        self._keep(task)

    async def run(self, step: Step, *, every_s: float = 0.0, name: str | None = None) -> None:
        """``step`` under the policy, in the caller's task: for a part's main loop."""
        what = f"{self.owner}: {name or getattr(step, '__name__', 'loop')}"
        paced = step if every_s <= 0 else self._paced(step, every_s)
        try:
            await forever(paced, lambda: self.stopped, what)
        except Exception:
            log.exception("%s failed; stopping %s", what, self.part)
            self.fail()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run one-shot ``work`` in the background, kept referenced until done. Such work contains
        its own request's failures; one that escapes is logged, and stops nothing."""
        task = asyncio.create_task(work)
        self._keep(task)
        task.add_done_callback(self._log_failure)
        return task

    def fail(self) -> None:
        """A loop met a bug: the process stops, non-zero."""
        self.exit_code = self.exit_code or EXIT_FATAL
        self.stop()
        self._on_fail()

    def stop(self) -> None:
        self.stopping.set()

    async def close(self) -> None:
        """Stop, then cancel what still runs and wait for it (bounded: see ``cancel_and_wait``).

        Called on the way out, and by a part that must stop its loops before it does its last
        work itself (a DP rank leaving its broken group). The caller's own task is never
        cancelled: neither a ``run()`` in it nor one-shot work that calls ``close()``."""
        self.stop()
        await cancel_and_wait([task for task in self.pending() if task is not asyncio.current_task()])

    def pending(self) -> list[asyncio.Task[Any]]:
        """The loops and one-shot work still running (a snapshot), oldest first."""
        return [task for task in self._tasks if not task.done()]

    async def drain(self) -> None:
        """Wait until the one-shot work spawned so far has ended, without cancelling it (the
        loops started run until ``close()``; one-shot work spawned meanwhile is waited for too)."""
        while work := [t for t in self.pending() if t not in self._loops and t is not asyncio.current_task()]:
            await asyncio.wait(work)

    def _paced(self, step: Step, every_s: float) -> Step:
        async def paced() -> None:
            await step()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), every_s)

        paced.__name__ = getattr(step, "__name__", "loop")
        return paced

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._tasks[task] = None
        task.add_done_callback(lambda done: self._tasks.pop(done, None))

    def _log_failure(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: background work failed", self.owner, exc_info=task.exception())
