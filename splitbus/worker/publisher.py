"""What a worker writes for its requests: result entries, task acks and reservation clean-up,
buffered by the outbox as the core's effects come (``splitbus.worker.outbox``) and written by
one publisher loop, one write at a time, so entries keep their order; then the KV events the
engine's prefix cache made meanwhile (docs/routing.md, "KV events"). While Redis refuses (OOM,
outage) everything stays buffered; each list is cleared only once written."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from splitbus import aio
from splitbus.bus.core.streams import GroupConsumer
from splitbus.bus.kv_events import KvEventPublisher
from splitbus.bus.reservations import Reservations
from splitbus.worker.engines.interface import Engine
from splitbus.worker.outbox import Outbox

PUBLISH_IDLE_S = 0.5
"""With nothing asked, the publisher writes anyway this often (what a retry left)."""

Hook = Callable[[], Awaitable[None]]


class Publisher:
    """``publish()`` writes what the outbox holds; the publisher loop does once asked
    (``Outbox.soon``). ``before`` runs first in each write under ``lock`` (a worker back from a
    lapsed lease drops what moved away before writing for it: ``Lease.rejoin``);
    ``after_results`` runs once the results are out (the task feed gives back the scheduler's
    reservations). Each write ends with the engine's pending KV events, as one batch of ``kv``
    (the worker's ``KvEventPublisher``, its DP rank's own), once :meth:`start_kv_events` has run."""

    def __init__(
        self,
        redis: aioredis.Redis,
        kv: KvEventPublisher,
        engine: Engine,
        outbox: Outbox,
        tasks: GroupConsumer,
        reservations: Reservations,
        *,
        lock: asyncio.Lock,
        before: Hook,
        after_results: Hook,
    ) -> None:
        self.redis, self.kv, self.engine, self.outbox, self.writer = redis, kv, engine, outbox, outbox.writer
        self.tasks, self.reservations, self.lock = tasks, reservations, lock
        self.before, self.after_results = before, after_results
        self.kv_started = False
        self.kv_new_run = False
        """Set when Redis has a new run (which may have lost the latest batches and the
        snapshot): the next write writes the snapshot whatever its schedule."""

    # ------------------------------------------------------------ writing

    async def publish_when_asked(self) -> None:
        """The publisher loop's step: a write once asked (or every ``PUBLISH_IDLE_S``)."""
        await aio.wait(self.outbox.asked, PUBLISH_IDLE_S)
        self.outbox.asked.clear()
        await self.publish()

    async def publish(self) -> None:
        """Write the results, then ack finished tasks and drop stale reservations."""
        async with self.lock:
            await self.before()
            if self.writer.pending:
                await self.writer.flush()
            await self.tasks.send_graves()
            await self.after_results()
            await self._ack()
            await self._drop_stale_reservations()
            await self._publish_kv_events()

    async def start_kv_events(self) -> None:
        """Once the worker has joined the bus: announce its cache as empty (``AllBlocksCleared``,
        a new publisher instance) and write the first snapshot; safe to repeat. KV events go
        out from the next write on."""
        await self.kv.start()
        self.kv_started = True

    async def _publish_kv_events(self) -> None:
        """The engine's pending KV events as one batch (nothing when there are none), cleared
        once Redis took them; then the snapshot if it is due, asked for or owed."""
        if not self.kv_started:
            return
        cache = self.engine.kv_events
        if cache is not None and len(cache):
            events = cache.pending()
            # A send that fails part-way (past the batch bounds only) is sent whole again: the
            # batches it repeats leave a reader's set of blocks as they were.
            await self.kv.publish(events)
            cache.sent(len(events))
        if self.kv_new_run:
            await self.kv.after_new_run()
            self.kv_new_run = False
        else:
            await self.kv.maybe_snapshot()

    async def _ack(self) -> None:
        if self.outbox.done_entries:
            done = list(self.outbox.done_entries)
            await self.tasks.ack(*done)
            del self.outbox.done_entries[: len(done)]

    async def _drop_stale_reservations(self) -> None:
        if self.outbox.stale_reservations:
            stale = list(self.outbox.stale_reservations)
            pipe = self.redis.pipeline(transaction=False)
            for request_id, entry_id in stale:
                await self.reservations.drop(request_id, entry_id, client=pipe)
            await pipe.execute()
            del self.outbox.stale_reservations[: len(stale)]
