"""asyncio helpers shared by every part."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout_s: float = 2.0) -> None:
    """Cancel tasks and wait for them, but not forever.

    redis-py 8 can swallow the cancellation of a task that is inside a command (seen on
    blocking reads and on plain commands during shutdown); such a task must not hold up a
    shutdown. Loops also check their own stop flag, so they end at their next turn anyway.
    """
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)
