"""The scheduler process: read requests, place them by load, write their tasks.

Several replicas share the ``schedulers`` group; each request goes to one of them. A request
that no worker can take yet waits (unacked, so a crash does not lose it) up to
``no_worker_wait_s``, then its client gets a 503.

Each replica holds a lease (``sb:scheduler-lease:{name}``) renewed by a loop of its own. Every
``claim_every_s`` the live replicas look at the group's consumers: the entries pending with a
replica whose lease is gone (it died, or hung: a stopped process's blocked read is still served
by Redis, and what it gets stays pending with it) are claimed at once; entries pending longer
than ``claim_idle_ms`` with a replica that still holds its lease (alive but stuck) are claimed
too. A replica acts on an entry only while it is still pending with it: the dispatch script
checks, and so does ``fail``, so a replica that wakes from a hang writes nothing for what it
lost.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from splitbus.bus.aio import cancel_and_wait
from splitbus.bus.config import BusConfig
from splitbus.bus.connection import connect, forever, is_transient, transient_suppressed, until_done
from splitbus.bus.keys import SCHEDULER_GROUP
from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Registry, RegistryView, Reserved, SchedulerLease
from splitbus.bus.results import ResultWriter
from splitbus.bus.scheduler import metrics
from splitbus.bus.scheduler.config import SchedulerConfig
from splitbus.bus.scheduler.dispatch import DISPATCHED, NOT_OURS, Dispatcher
from splitbus.bus.scheduler.policy import (
    Placement,
    Policy,
    blocks_needed,
    dp_placement,
    dp_ranks,
    free_blocks,
    queued_prefill,
)
from splitbus.bus.scheduler.reaper import Reaper
from splitbus.bus.scheduler.stagger import RELEASE_LEAD_S, Job, RankLoad, StaggerWindow, group_boundary_s, water_fill
from splitbus.bus.streams import Delivery, GroupConsumer, trim_consumed

log = logging.getLogger(__name__)
T = TypeVar("T")
TRIM_EVERY_S = 5.0
EXIT_FATAL = 1
"""The exit code of a scheduler stopped by a fatal error (a bug in a loop, never an entry)."""


@dataclass
class Waiting:
    delivery: Delivery
    since: float


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        bus: BusConfig = config.bus
        self.redis = connect(bus, max_connections=8, name=config.name)
        self.requests = GroupConsumer(
            self.redis, bus, bus.keys.requests, SCHEDULER_GROUP, config.name, on_dead=self.fail_dead
        )
        self.registry = Registry(self.redis, bus)
        self.lease = SchedulerLease(self.redis, bus, config.name, config.lease_ms)
        self._leased = False
        self.view = RegistryView(self.registry, config.refresh_s)
        self.policy = Policy(config.mode)
        self.dispatcher = Dispatcher(self.redis, bus, config.dispatched_ttl_s)
        self.writer = ResultWriter(self.redis, bus)
        self.waiting: list[Waiting] = []
        self.local: dict[str, Reserved] = {}
        """Reservations made since the last registry snapshot."""
        self._placing = asyncio.Lock()
        """Held while requests are placed: by the scheduling loop, and by the claimer, which
        places what it claimed at once rather than after the loop's blocked read returns."""
        self.reaper = Reaper(self.redis, bus, config.name, self.view, self.policy, self.dispatcher, self.local)
        self.window: StaggerWindow[Waiting] | None = None
        self._batches = itertools.count()
        if config.mode == "dp" and config.stagger:
            self.window = StaggerWindow(max_wait_s=config.stagger_max_wait_s)
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        """The scheduling loop until stopped, under ``forever``'s one policy (as are the
        background loops): Redis refusing (down, LOADING, OOM...) is waited out; a request that
        cannot be handled is dead-lettered with the reason and failed to its client, alone;
        anything else is a bug, and the scheduler stops with exit code ``EXIT_FATAL``."""
        await self.start()
        try:
            await self.background(self.step)
        finally:
            await self.close()

    async def step(self) -> None:
        """Read what there is room to wait for, then place everything that can be placed."""
        arrivals = await self.read_requests()
        async with self._placing:
            if self.window is None:
                self.waiting += arrivals
            else:
                await self.hold(arrivals)
            await self.place_waiting()

    async def place_waiting(self) -> None:
        """Place what waits (with the lock held); what cannot be placed yet waits on."""
        self.waiting = await self.place_all(self.waiting)
        if self.writer.pending:  # errors for requests dead-lettered as they were read
            await self.writer.flush()

    async def place_all(self, waiting: list[Waiting]) -> list[Waiting]:
        """Decide each request in order (each decision sees the earlier ones' reservations),
        then write all their tasks at once: the dispatch scripts share one pipeline. Returns
        the requests still waiting for a worker."""
        left, writes = [], []
        for w in waiting:
            placements = await self.contained(w, self.decide(w))
            if placements is None:
                left.append(w)
            elif placements:
                writes.append(self.contained(w, self.dispatch(w, w.delivery.message, placements)))
        await asyncio.gather(*writes)
        return left

    async def contained(self, waiting: Waiting, work: Awaitable[T]) -> T | list[Placement]:
        """Run one request's decision or dispatch. If it fails for any reason but Redis
        refusing for now, that request is dead-lettered with the error and failed to its client,
        and the others go on: one request never stops the scheduler."""
        try:
            return await work
        except Exception as exc:
            if is_transient(exc):
                raise
            log.exception("request entry %s failed", waiting.delivery.entry_id)
            await self.poison(waiting, f"handler_failed: {type(exc).__name__}: {exc}")
            return []

    async def poison(self, waiting: Waiting, reason: str) -> None:
        if not await self.requests.owns(waiting.delivery.entry_id):
            return  # another replica holds it now, and decides
        await self.requests.dead_letter(waiting.delivery, reason)
        request = waiting.delivery.message
        if isinstance(request, GenerateRequest):
            self.fail_dead(request.request_id, reason)  # flushed at the end of the step

    def fail_dead(self, request_id: str, reason: str) -> None:
        """The client of a dead-lettered request entry gets the reason, not a wait until its
        deadline (the entry is flushed with the step's results)."""
        message = f"the scheduler could not handle this request: {reason}"
        self.writer.fail(request_id, reason.split(":", 1)[0], message, 500)

    async def hold(self, arrivals: list[Waiting]) -> None:
        """dp mode with staggering: arrivals wait in the window, then go out as one batch."""
        assert self.window is not None
        if arrivals and self.window.opened_at is None:
            self.window.open(arrivals[0].since, await self.next_boundary())
        for waiting in arrivals:
            self.window.add(waiting)
        if self.window.ready(time.monotonic()):
            self.waiting += await self.place_batch(self.window.release())

    async def next_boundary(self) -> float:
        """When the first DP group's running step ends, less ``RELEASE_LEAD_S`` (this process's
        monotonic clock), from what its ranks announced; read fresh, as a registry snapshot is
        older than a decode step. The ranks' wall clocks are taken to agree with this one to
        within a few ms, as NTP keeps them."""
        by_group: dict[str, list[int]] = {}
        ranks = [w for w in self.view.live() if w.record.dp_size > 0]
        for rank, end_ms in zip(ranks, await self.registry.forward_ends([r.record.worker_id for r in ranks])):
            by_group.setdefault(rank.record.dp_group, []).append(end_ms)
        return time.monotonic() + group_boundary_s(by_group) - time.time() - RELEASE_LEAD_S

    async def place_batch(self, batch: list[Waiting]) -> list[Waiting]:
        """Water-fill the batch over the DP ranks; returns what it could not place."""
        left = [w for w in batch if not isinstance(w.delivery.message, GenerateRequest)]
        by_model: dict[str, list[Waiting]] = {}
        for w in batch:
            if isinstance(w.delivery.message, GenerateRequest):
                by_model.setdefault(w.delivery.message.model, []).append(w)
        for model, group in by_model.items():
            left += await self._fill(model, group)
        return left

    async def _fill(self, model: str, group: list[Waiting]) -> list[Waiting]:
        ranks = {r.record.worker_id: r for r in dp_ranks(self.view.workers, model)}
        loads = [
            RankLoad(
                rid, queued_prefill(r, self.local.get(rid, Reserved())), free_blocks(r, self.local.get(rid, Reserved()))
            )
            for rid, r in ranks.items()
        ]
        if not ranks:
            return group
        block_size = next(iter(ranks.values())).record.block_size
        jobs = {w.delivery.entry_id: w for w in group}
        sizes = [
            Job(k, len(w.delivery.message.prompt_token_ids), blocks_needed(w.delivery.message, block_size))
            for k, w in jobs.items()
        ]
        placed = water_fill(sizes, loads)
        batch_id, batch_ranks = f"{self.config.name}.{next(self._batches)}", len(set(placed.values()))
        writes = []
        for key, rank_id in placed.items():
            request = jobs[key].delivery.message
            placement = dp_placement(ranks[rank_id], request, batch_id, batch_ranks)
            self._reserve_locally(placement)
            writes.append(self.contained(jobs[key], self.dispatch(jobs[key], request, [placement])))
        await asyncio.gather(*writes)
        return [w for k, w in jobs.items() if k not in placed]

    async def start(self) -> None:
        await until_done(self.requests.ensure_group, self.redis, self.stopping.is_set, "start-up")
        await until_done(self.lease.renew, self.redis, self.stopping.is_set, "start-up")
        self._leased = True
        await self.view.refresh()
        self._tasks = [
            asyncio.create_task(self.view.run()),
            asyncio.create_task(self.background(self.renew_lease)),
            asyncio.create_task(self.background(self.claim_orphans)),
            asyncio.create_task(self.reaper.run(self.config.reap_every_s)),
            asyncio.create_task(self.background(self.trim_requests)),
        ]
        log.info("scheduler %s (%s) started", self.config.name, self.config.mode)

    async def close(self) -> None:
        self.stopping.set()
        self.view.stop()
        self.reaper.stopped = True
        await cancel_and_wait(self._tasks)
        with transient_suppressed("releasing the scheduler lease"):
            await self.lease.release()  # the others take what is still pending with us at once
        await self.redis.aclose()

    async def background(self, step: Callable[[], Awaitable[None]]) -> None:
        """A background loop under ``forever``; a fatal error stops the scheduler, non-zero."""
        try:
            await forever(step, self.stopping.is_set, f"scheduler {self.config.name}: {step.__name__}")
        except Exception:
            log.exception("%s failed; stopping the scheduler", step.__name__)
            self.exit_code = EXIT_FATAL
            self.stopping.set()

    async def read_requests(self) -> list[Waiting]:
        room = self.config.batch - len(self.waiting)
        block_ms = self._block_ms()
        if room > 0 and self._window_due():
            assert block_ms is not None
            deliveries = await self.requests.read_within(room, block_ms)  # the window must close on time
        elif room > 0:
            deliveries = await self.requests.read(room, block_ms=block_ms)
        else:
            deliveries = []
            await asyncio.sleep(self.config.refresh_s)
        if self.view.refreshed.is_set():
            self.view.refreshed.clear()
            self.local.clear()  # the fresh snapshot holds our reservations now
        now = time.monotonic()
        return [Waiting(d, now) for d in deliveries]

    def _window_due(self) -> bool:
        return self.window is not None and self.window.due_at() is not None

    def _block_ms(self) -> int | None:
        """How long a read may block: until the stagger window is due, or the next registry
        refresh when requests wait for a worker, else the bus default."""
        due = self.window.due_at() if self.window is not None else None
        if due is not None:
            return max(1, int((due - time.monotonic()) * 1000))
        return int(self.config.refresh_s * 1000) if self.waiting else None

    async def decide(self, waiting: Waiting) -> list[Placement] | None:
        """The tasks to write for a request; [] when it is done with (failed to its client, or
        dead-lettered), None while it waits for a worker with room."""
        request = waiting.delivery.message
        if not isinstance(request, GenerateRequest):
            await self.poison(waiting, f"handler_failed: a {type(request).__name__} entry is not a request")
            return []
        if request.deadline_ms and time.time() * 1000 > request.deadline_ms:
            await self.fail(waiting, "deadline", "the request's deadline passed before it was scheduled", 504)
            return []
        placement = self.policy.place(request, self.view.workers, self.local)
        if isinstance(placement, str):
            if time.monotonic() - waiting.since > self.config.no_worker_wait_s:
                await self.fail(waiting, "no_worker", placement, 503)
                return []
            return None
        for p in placement:  # the next decisions must see this load before it is written
            self._reserve_locally(p)
        return placement

    async def dispatch(self, waiting: Waiting, request: GenerateRequest, placements: list[Placement]) -> None:
        outcome = await self.dispatcher.dispatch(waiting.delivery.entry_id, request, placements, self.config.name)
        if log.isEnabledFor(logging.DEBUG):  # per request: the placement list only when it is logged
            log.debug(
                "dispatch of %s (entry %s) to %s: outcome %d",
                request.request_id,
                waiting.delivery.entry_id,
                [p.worker.record.worker_id for p in placements],
                outcome,
            )
        if outcome == NOT_OURS:
            log.info(
                "request entry %s is no longer this replica's (acked, or claimed by another): nothing written",
                waiting.delivery.entry_id,
            )
        metrics.DISPATCHES.labels(_OUTCOMES.get(outcome, "unknown")).inc()
        if outcome == DISPATCHED and waiting.delivery.published_us is not None:
            metrics.QUEUE_WAIT.observe(max(0.0, time.time() - waiting.delivery.published_us / 1e6))

    def _reserve_locally(self, placement: Placement) -> None:
        worker_id = placement.worker.record.worker_id
        mine, add = self.local.get(worker_id, Reserved()), placement.reserve
        self.local[worker_id] = Reserved(
            mine.reserved_prefill_tokens + add.reserved_prefill_tokens,
            mine.reserved_requests + add.reserved_requests,
            mine.reserved_kv_blocks + add.reserved_kv_blocks,
        )

    async def fail(self, waiting: Waiting, code: str, message: str, status: int) -> bool:
        """Fail the request to its client, if its entry is still ours (a replica that hung past
        its lease lost it to another, which decides)."""
        request = waiting.delivery.message
        if not await self.requests.owns(waiting.delivery.entry_id):
            return False
        log.warning("failing %s: %s", request.request_id, message)
        self.writer.fail(request.request_id, code, message, status)
        await self.writer.flush()
        await self.requests.ack(waiting.delivery.entry_id)
        metrics.DISPATCHES.labels(code).inc()
        return True

    async def trim_requests(self) -> None:
        """Delete request entries every replica has acked: the stream stays as long as its backlog."""
        await asyncio.sleep(TRIM_EVERY_S)
        await trim_consumed(self.redis, self.config.bus.keys.requests)

    async def renew_lease(self) -> None:
        """Renew this replica's lease, apart from the scheduling loop (a slow step keeps it)."""
        if not await self.lease.renew() and self._leased:
            log.warning(
                "scheduler %s: its lease had lapsed (hung, or cut off from Redis, over %d ms); "
                "what was pending with it may be the other replicas' now; rejoining",
                self.config.name,
                self.config.lease_ms,
            )
        self._leased = True
        await asyncio.sleep(self.config.heartbeat_s)

    async def claim_orphans(self) -> None:
        """Take over requests that a dead or hung replica read but never dispatched: at once
        when its lease is gone, after ``claim_idle_ms`` when it still holds its lease."""
        await asyncio.sleep(self.config.claim_every_s)
        claimed = await self.claim_from_gone() + await self.requests.claim_idle()
        if claimed:
            now = time.monotonic()
            async with self._placing:  # kept in ``waiting`` first: a Redis error loses none of them
                self.waiting += [Waiting(d, now) for d in claimed]
                await self.place_waiting()

    async def claim_from_gone(self) -> list[Delivery]:
        """The entries pending with replicas whose lease is gone; such a replica with nothing
        pending, idle past ``dead_consumer_keep_s``, is deleted from the group."""
        others = [c for c in await self.requests.consumers() if c.name != self.config.name]
        claimed: list[Delivery] = []
        for consumer, held in zip(others, await self.lease.held([c.name for c in others])):
            if held:
                continue
            if consumer.pending:
                taken = await self.requests.claim_from(consumer.name)
                log.warning(
                    "claimed %d request entr(ies) of scheduler %s (its lease expired)", len(taken), consumer.name
                )
                claimed += taken
            elif consumer.idle_ms > self.config.dead_consumer_keep_s * 1000 and await self.requests.forget(
                consumer.name
            ):
                log.info("scheduler %s left the group (no lease, nothing pending)", consumer.name)
        return claimed


_OUTCOMES = {1: "dispatched", 0: "already_acked", -1: "duplicate"}
