"""A worker's lease, a bus edge: the heartbeat that keeps it, and the way back after it lapsed
(SIGSTOP, a long pause, an outage), when a reaper may have moved this worker's tasks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from splitbus.bus.core.keys import Keys
from splitbus.bus.reaping import Reaping
from splitbus.bus.registry import Registry, WorkerRecord

log = logging.getLogger(__name__)
REAPED_WAIT_S = 10.0
"""A worker back from a lapsed lease whose reaper has started waits this long for it to finish."""
REJOIN_HOLD_S = 2
"""After a rejoin, ``sb:reaping:{cell}:<worker>`` is kept this long: a reaper acting on a registry
snapshot from before the rejoin (100 ms old at most) cannot take the worker again."""


class Lease:
    """``record`` is what each beat writes, for a lease of ``lease_ms``; ``drop_moved`` drops the
    tasks a reaper took (the task feed's); ``lock`` is the publisher's, held while a rejoin
    settles."""

    def __init__(
        self,
        worker_id: str,
        lease_ms: int,
        redis: aioredis.Redis,
        keys: Keys,
        registry: Registry,
        record: Callable[[], WorkerRecord],
        drop_moved: Callable[[], Awaitable[None]],
        lock: asyncio.Lock,
        before_beat: Callable[[], Awaitable[None]] | None = None,
        after_beat: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.id, self.lease_ms, self.redis, self.keys, self.registry = worker_id, lease_ms, redis, keys, registry
        self.record, self.drop_moved, self.lock = record, drop_moved, lock
        self.before_beat, self.after_beat = before_beat, after_beat
        """Run at each heartbeat, after a beat that renews a live lease and before the rest: the
        worker's watch for a new Redis run, and its recovery after one (``recovery``). Before a
        rejoin: a rejoin must know of the new run."""
        self.reaping = Reaping(redis, self.keys)
        self.last_beat = 0.0  # monotonic time of the last heartbeat Redis took (before its call)

    async def heartbeat(self) -> None:
        """The heartbeat loop's step (every ``heartbeat_s``)."""
        # The whole record each time (~20 small fields): a worker whose record was removed, say
        # by a reaper during a long Redis outage, is whole again at its next beat.
        # The beat first: the watch for a new run asks every primary of a cluster, and one that
        # is down (failing over, even one that holds no control-plane key) fails the step. Were
        # the beat after it, the lease would lapse for that primary's outage and the worker be
        # reaped with every stream it serves (tests/faults/test_cluster_failover.py saw it).
        if not self.lapsed():
            await self.beat()
        if self.before_beat is not None:
            await self.before_beat()
        if self.lapsed():
            await self.settle_if_lapsed()
        if self.after_beat is not None:
            await self.after_beat()

    async def beat(self) -> None:
        before = time.monotonic()
        await self.registry.register(self.record(), self.lease_ms)
        self.last_beat = before

    def lapsed(self) -> bool:
        """Whether the lease may have expired: no beat for a lease (the process was stopped,
        hung, or cut off from Redis). Monotonic time counts while a process is stopped. False
        before the first beat (nothing is held yet)."""
        return bool(self.last_beat) and time.monotonic() - self.last_beat > self.lease_ms / 1000

    async def settle_if_lapsed(self) -> None:
        """Rejoin first if the lease lapsed; under the publish lock, so that nothing is written
        until the worker knows what moved away. A local check when it did not."""
        if self.lapsed():
            async with self.lock:
                await self.rejoin()

    async def rejoin(self) -> None:
        """Back after the lease lapsed: whoever takes ``sb:reaping:{cell}:<worker>`` first decides. If
        this worker takes it, no reaper can start and it keeps everything; if a reaper has it,
        the worker waits for it to finish, drops every request whose task the reaper took (no
        longer pending to this worker), with what it buffered for them unwritten, and joins
        again. Runs under the publish lock: no late write goes out before this is settled."""
        if not self.lapsed():
            return
        log.warning(
            "worker %s: no heartbeat for %.1f s, more than its lease; rejoining",
            self.id,
            time.monotonic() - self.last_beat,
        )
        if not await self.reaping.take(self.id, f"{self.id}:rejoining"):
            await self.wait_until_reaped()
            await self.drop_moved()
        await self.beat()
        await self.reaping.hold(self.id, REJOIN_HOLD_S)
        log.warning("worker %s rejoined the live set", self.id)

    async def wait_until_reaped(self) -> None:
        deadline = time.monotonic() + REAPED_WAIT_S
        while time.monotonic() < deadline:
            if await self.registry.is_dead(self.id):
                return
            await asyncio.sleep(0.05)
        log.warning("worker %s: its reaper did not finish within %.0f s; dropping what it took", self.id, REAPED_WAIT_S)
