"""After a new Redis server run: the scheduler's part of re-publishing what Redis lost.

A restart (from an AOF that missed its last second) or a failover (to a replica that missed the
last writes) leaves a prefix of what was written. The dispatch script writes nothing while the
server's run is not the one the cell was settled on (``sb:run:{cell}``): for ``recovery_grace_s``
the workers re-assert the dispatches they hold (a task they read before the loss) and the API
re-publishes the requests it lost; then a replica settles the cell, and takes again the request
entries pending with it that it no longer holds: delivered to it before the loss, their
dispatch lost with it (the dispatch script finds any that runs somewhere a duplicate).
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis

from splitbus.bus.core.keys import Keys
from splitbus.bus.runs import CellRun

log = logging.getLogger(__name__)


class Recovery:
    """Whether this replica may dispatch. ``check`` is a loop step (every heartbeat), ``begin``
    is called when a dispatch found the cell not settled; ``step`` says when the grace is over
    (the caller then re-reads what is pending with it)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, grace_s: float, name: str) -> None:
        self._cell = CellRun(redis, keys)
        self._grace_s = grace_s
        self._name = name
        self.since: float | None = None
        """When this replica saw the cell unsettled; None while it is settled."""

    @property
    def recovering(self) -> bool:
        return self.since is not None

    async def start(self, holding: int) -> None:
        """At start: a cell where no live worker holds a request has nothing to re-assert (a
        fresh bus) and is settled now; one not settled on this run where ``holding`` workers hold
        requests is recovered as after a loss."""
        if await self._cell.settled():
            return
        if holding == 0:
            await self._cell.settle()
        else:
            self.begin()

    def begin(self) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.warning(
                "scheduler %s: Redis is a new server run (restart or failover; the latest writes may be lost):"
                " dispatching nothing for %.1f s while workers re-assert what they hold",
                self._name,
                self._grace_s,
            )

    async def check(self) -> None:
        """Begin recovering if the server's run is not the cell's settled one."""
        if self.since is None and not await self._cell.settled():
            self.begin()

    async def step(self) -> bool:
        """Settle the cell once the grace is over; True when it did (dispatch again)."""
        if self.since is None or time.monotonic() - self.since < self._grace_s:
            return False
        await self._cell.settle()
        self.since = None
        log.warning("scheduler %s: the cell is settled on the new Redis run; dispatching again", self._name)
        return True
