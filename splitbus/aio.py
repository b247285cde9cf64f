"""The event loop every splitbus process runs on."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on uvloop where it is installed (every service does: its timers and
    its socket writes are cheaper), else on asyncio's own loop. Benchmarks that stand in for a
    service's side (a worker's sleeps, the load a bench generates) use it too, so that what they
    measure is not the slower loop's. What the process built before (its imports, a worker's
    model) is frozen out of the garbage collector's scans first (``freeze_heap``): a process that
    calls this more than once (a benchmark, a setting at a time) freezes what is alive at each
    call, whatever the earlier runs left."""
    freeze_heap()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def wait(event: asyncio.Event, timeout_s: float) -> None:
    """Wait for ``event``, at most ``timeout_s``, in the calling task. ``asyncio.wait_for`` runs
    the wait as a task of its own (Python 3.11), so a ``set()`` reaches the waiter some loop turns
    later, after whatever became ready meanwhile; waiting here, the waiter is the next to run.
    (A worker's engine loop woke 0.45 ms after its feed took a task, 0.04 ms with this and the
    feed's yield: docs/benchmarks.md.)"""
    if sys.version_info >= (3, 11):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await event.wait()
    else:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)


def freeze_heap() -> None:
    """Collect once, then move every object alive into the collector's permanent generation: a
    service calls this once it is built, before it serves. Its long-lived objects (the modules
    it imported, a model's layers) are otherwise scanned by every full collection, and a full
    collection stops the event loop (tens of ms in a scheduler on 2 cores: docs/benchmarks.md).
    Frozen objects freed later by reference count are still freed; a cycle among them that
    became garbage would not be, which is why only what lives as long as the service is frozen."""
    gc.collect()
    gc.freeze()
