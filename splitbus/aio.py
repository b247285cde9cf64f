"""The event loop every splitbus process runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on uvloop where it is installed (every service does: its timers and
    its socket writes are cheaper), else on asyncio's own loop. Benchmarks that stand in for a
    service's side (a worker's sleeps, the load a bench generates) use it too, so that what they
    measure is not the slower loop's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
