"""What a worker writes for its requests: result entries, task acks and reservation clean-up,
the core's effects buffered as they come and written by one publisher loop, one write at a
time, so entries keep their order; then the KV events the engine's prefix cache made meanwhile
(docs/routing.md, "KV events"). While Redis refuses (OOM, outage) everything stays buffered;
each list is cleared only once written."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from splitbus import aio
from splitbus.bus.core.streams import GroupConsumer
from splitbus.bus.kv_events import KvEventPublisher
from splitbus.bus.reservations import Reservations
from splitbus.bus.results import ResultWriter
from splitbus.worker import metrics
from splitbus.worker.effects import Ack, Discard, DropReservation, Effect, Emit, Fail, Finish, Forget, Open
from splitbus.worker.engines.interface import Engine

log = logging.getLogger(__name__)
PUBLISH_IDLE_S = 0.5
"""With nothing asked, the publisher writes anyway this often (what a retry left)."""

Hook = Callable[[], Awaitable[None]]


class Publisher:
    """``buffer`` takes the core's effects that are writes (result entries, acks, reservation
    clean-up); ``soon()`` asks for a write; ``publish()`` writes. ``before`` runs first in each
    write under the lock (a worker back from a lapsed lease drops what moved away before writing
    for it); ``after_results`` runs once the results are out (the task feed gives back the
    scheduler's reservations). Each write ends with the engine's pending KV events, as one batch
    of ``kv`` (the worker's ``KvEventPublisher``, its DP rank's own), once
    :meth:`start_kv_events` has run."""

    def __init__(
        self,
        redis: aioredis.Redis,
        kv: KvEventPublisher,
        engine: Engine,
        writer: ResultWriter,
        tasks: GroupConsumer,
        reservations: Reservations,
        *,
        before: Hook,
        after_results: Hook,
    ) -> None:
        self.redis, self.kv, self.engine = redis, kv, engine
        self.writer, self.tasks, self.reservations = writer, tasks, reservations
        self.before, self.after_results = before, after_results
        self.done_entries: list[str] = []  # task entries to ack at the next publish
        self.stale_reservations: list[tuple[str, str]] = []  # (request, task entry) of decode tasks that left
        self.lock = asyncio.Lock()
        self.asked = asyncio.Event()
        self.kv_started = False
        self.kv_new_run = False
        """Set when Redis has a new run (which may have lost the latest batches and the
        snapshot): the next write writes the snapshot whatever its schedule."""

    # ------------------------------------------------------------ what the core leaves

    def buffer(self, effect: Effect) -> None:
        """One of the core's effects, if it is a write (see ``splitbus.worker.effects``)."""
        match effect:
            case Emit(request_id, token_ids, text):
                self.writer.tokens(request_id, list(token_ids), text)
                metrics.GENERATION_TOKENS.inc(len(token_ids))
            case Finish(request_id, reason, prompt, completion, text, cached):
                metrics.REQUESTS_FINISHED.labels(reason).inc()
                self.writer.finish(request_id, reason, prompt, completion, text, cached_tokens=cached)
            case Fail():
                self.buffer_failure(effect)
            case Open(request_id, reader, first_seq):
                self.writer.open(request_id, reader=reader, first_seq=first_seq)
            case Forget(request_id):
                self.writer.forget(request_id)
            case Discard(request_id):
                self.writer.discard(request_id)
            case Ack(entry_id):
                self.ack_later(entry_id)
            case DropReservation(request_id, entry_id):
                self.stale_reservations.append((request_id, entry_id))

    def buffer_failure(self, failed: Fail) -> None:
        if failed.warn:
            log.warning("request %s failed: %s", failed.request_id, failed.message)
        metrics.REQUESTS_FINISHED.labels(failed.code).inc()
        self.writer.fail(failed.request_id, failed.code, failed.message, failed.status, reader=failed.reader)

    def ack_later(self, entry_id: str) -> None:
        """Ack this task entry at the next publish (it is done with here)."""
        self.done_entries.append(entry_id)

    # ------------------------------------------------------------ writing

    def soon(self) -> None:
        self.asked.set()

    async def publish_when_asked(self) -> None:
        """The publisher loop's step: a write once asked (or every ``PUBLISH_IDLE_S``)."""
        await aio.wait(self.asked, PUBLISH_IDLE_S)
        self.asked.clear()
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
        if self.done_entries:
            done = list(self.done_entries)
            await self.tasks.ack(*done)
            del self.done_entries[: len(done)]

    async def _drop_stale_reservations(self) -> None:
        if self.stale_reservations:
            stale = list(self.stale_reservations)
            pipe = self.redis.pipeline(transaction=False)
            for request_id, entry_id in stale:
                await self.reservations.drop(request_id, entry_id, client=pipe)
            await pipe.execute()
            del self.stale_reservations[: len(stale)]
