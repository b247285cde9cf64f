"""The scheduler process: read requests, place them by load, write their tasks.

Several replicas share the ``schedulers`` group; each request goes to one of them. A request
that no worker can take yet waits (unacked, so a crash does not lose it) up to
``no_worker_wait_s``, then its client gets a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

from splitbus.bus.aio import cancel_and_wait
from splitbus.bus.config import BusConfig
from splitbus.bus.connection import TRANSIENT_ERRORS, backoff_delays, connect
from splitbus.bus.keys import SCHEDULER_GROUP
from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Registry, RegistryView, Reserved
from splitbus.bus.results import ResultWriter
from splitbus.bus.scheduler import metrics
from splitbus.bus.scheduler.config import SchedulerConfig
from splitbus.bus.scheduler.dispatch import DISPATCHED, Dispatcher
from splitbus.bus.scheduler.policy import Placement, Policy
from splitbus.bus.streams import Delivery, GroupConsumer

log = logging.getLogger(__name__)


@dataclass
class Waiting:
    delivery: Delivery
    since: float
    reason: str = ""


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        bus: BusConfig = config.bus
        self.redis = connect(bus, max_connections=8, name=config.name)
        self.requests = GroupConsumer(self.redis, bus, bus.keys.requests, SCHEDULER_GROUP, config.name)
        self.view = RegistryView(Registry(self.redis, bus), config.refresh_s)
        self.policy = Policy(config.mode)
        self.dispatcher = Dispatcher(self.redis, bus, config.dispatched_ttl_s)
        self.writer = ResultWriter(self.redis, bus)
        self.waiting: list[Waiting] = []
        self.local: dict[str, Reserved] = {}
        """Reservations made since the last registry snapshot."""
        self._claimed: list[Delivery] = []
        self.stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        await self.start()
        try:
            while not self.stopping.is_set():
                await self.step_safely()
        finally:
            await self.close()

    async def step(self) -> None:
        """Read what there is room to wait for, then place everything that can be placed."""
        self.waiting += await self.read_requests()
        self.waiting = [w for w in self.waiting if not await self.try_place(w)]

    async def start(self) -> None:
        await self.requests.ensure_group()
        await self.view.refresh()
        self._tasks = [asyncio.create_task(self.view.run()), asyncio.create_task(self.claim_orphans())]
        log.info("scheduler %s (%s) started", self.config.name, self.config.mode)

    async def close(self) -> None:
        self.stopping.set()
        self.view.stop()
        await cancel_and_wait(self._tasks)
        await self.redis.aclose()

    async def step_safely(self) -> None:
        try:
            await self.step()
        except TRANSIENT_ERRORS as exc:
            log.warning("Redis unavailable (%s); retrying", exc)
            async for _ in backoff_delays():
                with contextlib.suppress(*TRANSIENT_ERRORS):
                    await self.redis.ping()
                    return

    async def read_requests(self) -> list[Waiting]:
        room = self.config.batch - len(self.waiting)
        # With requests waiting for a worker, wake at each registry refresh to retry them.
        block_ms = int(self.config.refresh_s * 1000) if self.waiting else None
        if room > 0:
            deliveries = await self.requests.read(room, block_ms=block_ms)
        else:
            deliveries = []
            await asyncio.sleep(self.config.refresh_s)
        if self.view.refreshed.is_set():
            self.view.refreshed.clear()
            self.local.clear()  # the fresh snapshot holds our reservations now
        deliveries, self._claimed = deliveries + self._claimed, []
        now = time.monotonic()
        return [Waiting(d, now) for d in deliveries]

    async def try_place(self, waiting: Waiting) -> bool:
        """Place one request; True when it is done with (dispatched, or failed to its client)."""
        request = waiting.delivery.message
        if not isinstance(request, GenerateRequest):
            await self.requests.dead_letter(waiting.delivery, "handler_failed")
            return True
        if request.deadline_ms and time.time() * 1000 > request.deadline_ms:
            return await self.fail(waiting, "deadline", "the request's deadline passed before it was scheduled", 504)
        placement = self.policy.place(request, self.view.workers, self.local)
        if isinstance(placement, str):
            waiting.reason = placement
            if time.monotonic() - waiting.since > self.config.no_worker_wait_s:
                return await self.fail(waiting, "no_worker", placement, 503)
            return False
        await self.dispatch(waiting, request, placement)
        return True

    async def dispatch(self, waiting: Waiting, request: GenerateRequest, placements: list[Placement]) -> None:
        outcome = await self.dispatcher.dispatch(waiting.delivery.entry_id, request, placements)
        metrics.DISPATCHES.labels(_OUTCOMES.get(outcome, "unknown")).inc()
        if outcome == DISPATCHED:
            metrics.QUEUE_WAIT.observe(max(0.0, time.time() - (waiting.delivery.published_us or 0) / 1e6))
            for p in placements:
                self._reserve_locally(p)

    def _reserve_locally(self, placement: Placement) -> None:
        worker_id = placement.worker.record.worker_id
        mine = self.local.get(worker_id, Reserved())
        added = [a + b for a, b in zip(dataclasses.astuple(mine), dataclasses.astuple(placement.reserve))]
        self.local[worker_id] = Reserved(*added)

    async def fail(self, waiting: Waiting, code: str, message: str, status: int) -> bool:
        request = waiting.delivery.message
        log.warning("failing %s: %s", request.request_id, message)
        self.writer.fail(request.request_id, code, message, status)
        await self.writer.flush()
        await self.requests.ack(waiting.delivery.entry_id)
        metrics.DISPATCHES.labels(code).inc()
        return True

    async def claim_orphans(self) -> None:
        """Take over requests that a dead replica read but never dispatched."""
        while not self.stopping.is_set():
            await asyncio.sleep(self.config.claim_every_s)
            with contextlib.suppress(*TRANSIENT_ERRORS):
                self._claimed += await self.requests.claim_idle()


_OUTCOMES = {1: "dispatched", 0: "already_acked", -1: "duplicate"}
