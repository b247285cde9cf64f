"""The scheduler process: read requests, place them by load, write their tasks.

Several replicas share the ``schedulers`` group; each request goes to one of them. A request
that no worker can take yet waits (unacked, so a crash does not lose it) up to
``no_worker_wait_s``, then its client gets a 503.

Each replica holds a lease (``sb:scheduler-lease:{cell}:<name>``) renewed by a loop of its own. Every
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
import dataclasses
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from enum import Enum
from typing import TypeVar

from redis.exceptions import RedisError

from splitbus import tracing
from splitbus.bus.core.codec import NamedRequest
from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect, is_transient, transient_suppressed, until_done
from splitbus.bus.core.loops import EXIT_FATAL, Loops
from splitbus.bus.core.streams import Delivery, entry_order
from splitbus.bus.dispatch import PLACE_AGAIN, DispatchOutcome, SettleOutcome
from splitbus.bus.kv_events import KvEventReader
from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Registry, SchedulerLease, WorkerInfo
from splitbus.bus.registry_view import RegistryView
from splitbus.bus.request_stream import request_consumer, trim_requests
from splitbus.bus.results import ResultWriter
from splitbus.bus.roles import Phase
from splitbus.bus.tenants import Tenant, TenantStore
from splitbus.placement import policies
from splitbus.placement.decision import Decision, NoPlacement, Placed, Placement, Waiting
from splitbus.placement.dispatcher import Dispatcher
from splitbus.placement.fairness import DEFAULT_WEIGHT, ServedTokens, tenant_of, waiting_order
from splitbus.placement.kv_index import KvIndex, KvIndexFeeder
from splitbus.placement.ledger import Ledger, Local
from splitbus.placement.policies.base import PlacingContext, Policy
from splitbus.placement.prefixes import NO_PREFIXES, IndexPrefixes
from splitbus.placement.siblings import Siblings, twins
from splitbus.scheduler import metrics, spans
from splitbus.scheduler.config import SchedulerConfig
from splitbus.scheduler.reaper import Reaper
from splitbus.scheduler.recovery import Recovery

log = logging.getLogger(__name__)
T = TypeVar("T")
TRIM_EVERY_S = 5.0
WEIGHTS_EVERY_S = 5.0
"""How often a replica reads the tenants' fair-share weights (a change takes effect within this)."""
KV_EVENTS_BLOCK_MS = 100
"""How long one read of the workers' KV event streams waits for a new batch."""
BUSY_POLL_MS = 10
"""How often the loop looks again while requests wait for a full prefill queue to open
(``--max-queued-prefill-tokens``): a worker reports its load as it takes a batch, the registry
view has it within milliseconds, and a request should not wait a whole ``refresh_s`` on top."""

__all__ = ["EXIT_FATAL", "Scheduler", "Verdict", "Waiting"]


class Verdict(Enum):
    """What becomes of a waiting request that gets no tasks now."""

    WAIT = "wait"
    """No worker has room for it yet: it waits, up to ``no_worker_wait_s``."""
    DROP = "drop"
    """Failed to its client, or dead-lettered: the scheduler is done with it."""


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        bus: BusConfig = config.bus
        self.redis = connect(bus, max_connections=8, name=config.name)
        self.requests = request_consumer(self.redis, bus, config.name, on_dead=self.fail_dead)
        self.registry = Registry(self.redis, bus)
        self.lease = SchedulerLease(self.redis, bus, config.name, config.lease_ms)
        self._leased = False
        self.view = RegistryView(self.registry, self.redis)
        self.kv_index = KvIndex()
        """Which worker holds which prefix blocks, from their KV events (docs/routing.md)."""
        self.kv_feeder = KvIndexFeeder(self.kv_index, KvEventReader(self.redis, bus))
        self.prefixes = IndexPrefixes(self.kv_index) if config.uses_kv_index else NO_PREFIXES
        self.policy = policies.create(config.policy, config.policy_options(), self.prefixes)
        self.siblings = Siblings()
        """Where each response's first choice went: its other choices follow (``n`` > 1)."""
        self.dispatcher = Dispatcher(self.redis, bus, config.dispatched_ttl_s)
        self.writer = ResultWriter(self.redis, bus)
        self.dead_letters: list[tuple[NamedRequest, str]] = []
        """(the request and its reader, reason) of entries dead-lettered since the last step: failed then."""
        self.waiting: list[Waiting] = []
        """Requests read and not placed yet, decided by priority, fair share, arrival (``place_waiting``)."""
        self.served = ServedTokens()
        """Prompt tokens this replica dispatched per tenant, decayed: the waiting queue's fair share."""
        self.weights: Mapping[str, float] = {}
        """Tenants' fair-share weights, read from the tenant store every ``WEIGHTS_EVERY_S``; a
        tenant not named here weighs 1 (``fairness.DEFAULT_WEIGHT``)."""
        self.tenants = TenantStore(self.redis, bus.keys)
        self.queued = metrics.QueuedByTenant()
        """``splitbus_scheduler_tenant_queued_requests``, from ``waiting``."""
        self.local = Local()
        """Reservations the registry snapshot does not show yet (kept by ``ledger``)."""
        self.ledger = Ledger(self.local)
        self.context = PlacingContext(self.view, self.registry, self.local)
        self._placing = asyncio.Lock()
        """Held while requests are placed: by the scheduling loop, and by the claimer, which
        places what it claimed at once rather than after the loop's blocked read returns."""
        self.reaper = Reaper(self.redis, bus, config.name, self.view, self._moves_policy(), self.dispatcher, self.local)
        self.recovery = Recovery(self.redis, bus.keys, config.recovery_grace_s, config.name)
        self._wake_at: float | None = None
        """When the policy wants the loop back for arrivals it holds (its last ``admit``)."""
        self._busy: dict[tuple[str, int], NoPlacement] = {}
        """The models whose workers' prefill queues were all full in this pass, whatever the
        request (``NoPlacement.model_wide``), by priority (an earlier one may head a full queue):
        their later requests of that priority are answered the same."""
        self._queue_waits = False
        """Whether a request of the last pass waits for a full prefill queue to open
        (``NoPlacement.busy``): the registry view shows one opening within milliseconds, so the
        loop looks again every ``BUSY_POLL_MS``."""
        self.loops = Loops(f"scheduler {config.name}", part="the scheduler")
        """Every loop of this replica, its main one included: a loop's bug stops it, exit code
        ``EXIT_FATAL``."""

    def _moves_policy(self) -> Policy:
        """The policy a dead worker's requests are placed again by: ``policy``, less the bound on
        prefill queues. They were admitted long ago, and a bound would fail them (``worker_died``)
        when the surviving workers' queues are full, the overload the bound is for."""
        if not self.config.max_queued_prefill_tokens:
            return self.policy
        unbounded = dataclasses.replace(self.config.policy_options(), max_queued_prefill_tokens=0)
        return policies.create(self.config.policy, unbounded, self.prefixes)

    @property
    def stopping(self) -> asyncio.Event:
        """Set to stop the replica (a signal, a loop's bug)."""
        return self.loops.stopping

    @property
    def exit_code(self) -> int:
        return self.loops.exit_code

    async def run(self) -> None:
        """The scheduling loop until stopped, under ``Loops``' one policy (as are the background
        loops): Redis refusing (down, LOADING, OOM...) is waited out; a request that cannot be
        handled is dead-lettered with the reason and failed to its client, alone; anything else
        is a bug, and the scheduler stops with exit code ``EXIT_FATAL``."""
        await self.start()
        try:
            await self.loops.run(self.step)
        finally:
            await self.close()

    async def start(self) -> None:
        await until_done(self.requests.ensure_group, self.redis, lambda: self.loops.stopped, "start-up")
        await until_done(self.lease.renew, self.redis, lambda: self.loops.stopped, "start-up")
        self._leased = True
        await self.view.refresh()
        holding = sum(w.alive and w.record.load.running + w.record.load.waiting > 0 for w in self.view.workers)
        await until_done(lambda: self.recovery.start(holding), self.redis, lambda: self.loops.stopped, "start-up")
        config = self.config
        self.loops.start(self.view.follow, name="registry view")
        self.loops.start(self.renew_lease, every_s=config.heartbeat_s)
        self.loops.start(self.claim_orphans, every_s=config.claim_every_s)
        self.loops.start(self.reap_dead, every_s=config.reap_every_s)
        self.loops.start(self.recover, every_s=config.heartbeat_s)
        self.loops.start(self.trim_requests, every_s=TRIM_EVERY_S)
        self.loops.start(self.read_weights, every_s=WEIGHTS_EVERY_S)
        if config.uses_kv_index:
            self.loops.start(self.follow_kv_events, name="KV events")
        log.info("scheduler %s (%s) started", config.name, config.mode)

    async def close(self) -> None:
        await self.loops.close()
        with transient_suppressed("releasing the scheduler lease"):
            await self.lease.release()  # the others take what is still pending with us at once
        await self.redis.aclose()

    async def step(self) -> None:
        """Read what there is room to wait for, let the policy admit it, then place everything
        that can be placed."""
        arrivals = await self.read_requests()
        async with self._placing:
            if self.recovery.recovering:  # placed once the cell is settled on the new Redis run
                self.waiting += arrivals
                self.queued.show(map(tenant_of, self.waiting))
                return
            admitted = await self.policy.admit(arrivals, self.context)
            self._wake_at = admitted.wake_at
            await self.write_batch(admitted.placed)
            self.waiting += admitted.queue
            await self.place_waiting()

    async def read_requests(self) -> list[Waiting]:
        room = self.config.batch - len(self.waiting)
        block_ms = self._block_ms()
        if room > 0 and (self._wake_at is not None or self._queue_waits):
            assert block_ms is not None
            deliveries = await self.requests.read_within(room, block_ms)  # due on time: not a BLOCK (read's docstring)
        elif room > 0:
            deliveries = await self.requests.read(room, block_ms=block_ms)
        else:
            deliveries = []
            await asyncio.sleep((BUSY_POLL_MS / 1000) if self._queue_waits else self.config.refresh_s)
        if self.view.refreshed.is_set():
            self.view.refreshed.clear()
            self.ledger.view_refreshed(self.view.read_at)  # what the fresh snapshot shows is forgotten
        now = time.monotonic()
        return [Waiting(d, now) for d in deliveries]

    def _block_ms(self) -> int | None:
        """How long a read may block: until the policy's wake-up (a batch window closing), or
        the next registry refresh when requests wait for a worker, else the bus default."""
        if self._queue_waits:
            wake = BUSY_POLL_MS if self._wake_at is None else (self._wake_at - time.monotonic()) * 1000
            return max(1, int(min(wake, BUSY_POLL_MS)))
        if self._wake_at is not None:
            return max(1, int((self._wake_at - time.monotonic()) * 1000))
        return int(self.config.refresh_s * 1000) if self.waiting else None

    async def place_waiting(self) -> None:
        """Place what waits (with the lock held), by priority, then tenants' fair share, then
        arrival: under overload the lowest priority waits longest, and is the first refused once
        it has waited ``no_worker_wait_s``. What cannot be placed yet waits on."""
        served = self.served.decayed(time.monotonic())
        ordered = waiting_order(self.waiting, served, self.weights, self.served.floor)
        self.waiting = await self.place_all(ordered)
        self.queued.show(map(tenant_of, self.waiting))
        await self.fail_dead_letters()  # requests dead-lettered as they were read
        if self.writer.pending:
            await self.writer.flush()

    async def place_all(self, waiting: list[Waiting]) -> list[Waiting]:
        """Decide each request in order (each decision sees the earlier ones' reservations),
        then write all their tasks at once: the dispatch scripts share one pipeline. Returns
        the requests still waiting for a worker."""
        left, decided = [], []
        self._busy, self._queue_waits = {}, False
        for w in waiting:
            decision = await self.contained(w, self.decide(w))
            if decision is Verdict.WAIT:
                left.append(w)
            elif isinstance(decision, Placed):
                decided.append((w, decision))
        placed = [w for w, _ in decided]
        stamped = zip(placed, twins([(w.delivery.message, d) for w, d in decided]), strict=True)  # choices together
        outcomes = await asyncio.gather(
            *(self.contained(w, self.dispatch(w, w.delivery.message, d.placements)) for w, d in stamped)
        )
        self.ledger.written()
        left += [w for w, outcome in zip(placed, outcomes, strict=True) if outcome in PLACE_AGAIN]
        return left

    async def write_batch(self, placed: list[tuple[Waiting, Placed]]) -> None:
        """Reserve and write what the policy placed as one batch, all at once: one dispatch per
        request."""
        for waiting, decision in placed:
            self._reserve_locally(decision)
            if isinstance(request := waiting.delivery.message, GenerateRequest):
                self.routed(request, decision.placements)
        outcomes = await asyncio.gather(
            *(self.contained(w, self.dispatch(w, w.delivery.message, d.placements)) for w, d in placed)
        )
        self.ledger.written()
        self.waiting += [w for (w, _), outcome in zip(placed, outcomes, strict=True) if outcome in PLACE_AGAIN]

    async def contained(self, waiting: Waiting, work: Awaitable[T]) -> T | Verdict:
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
            return Verdict.DROP

    async def poison(self, waiting: Waiting, reason: str) -> None:
        if not await self.requests.owns(waiting.delivery.entry_id):
            return  # another replica holds it now, and decides
        await self.requests.dead_letter(waiting.delivery, reason)
        request = waiting.delivery.message
        if isinstance(request, GenerateRequest):
            self.fail_dead(NamedRequest(request.request_id, request.reader), reason)  # flushed with the step

    def fail_dead(self, named: NamedRequest, reason: str) -> None:
        """The client of a dead-lettered request entry gets the reason, not a wait until its
        deadline (written with the step's results, ``fail_dead_letters``)."""
        self.dead_letters.append((named, reason))

    async def fail_dead_letters(self) -> None:
        """Fail the requests of the entries dead-lettered since the last step, unless the request
        is dispatched (the letter was a duplicate copy: its live run's stream is left alone) or
        failed already."""
        while self.dead_letters:
            named, reason = self.dead_letters[0]
            if await self.dispatcher.settle_failed("", named.request_id) is SettleOutcome.FAIL_IT:
                message = f"the scheduler could not handle this request: {reason}"
                self.writer.fail(named.request_id, reason.split(":", 1)[0], message, 500, reader=named.reader)
            del self.dead_letters[0]

    async def decide(self, waiting: Waiting) -> Placed | Verdict:
        """The tasks to write for a request, or why there are none now: it waits for a worker
        with room, or it is done with (failed to its client, or dead-lettered)."""
        request = waiting.delivery.message
        if not isinstance(request, GenerateRequest):
            await self.poison(waiting, f"handler_failed: a {type(request).__name__} entry is not a request")
            return Verdict.DROP
        if request.deadline_ms and time.time() * 1000 > request.deadline_ms:
            await self.fail(waiting, "deadline", "the request's deadline passed before it was scheduled", 504)
            return Verdict.DROP
        workers = self.view.workers
        decision = self.siblings.decide(request, workers, self.local, lambda: self._place(request, workers))
        if isinstance(decision, Placed):
            self._reserve_locally(decision)  # the next decisions must see this load before it is written
            self.routed(request, decision.placements)
            return decision
        if decision.busy and request.deadline_ms:  # until its deadline; without one, as any other wait
            self._busy.update({(request.model, request.priority): decision} if decision.model_wide else {})
            self._queue_waits = True
            waiting.since = time.monotonic()  # time waited for a full queue is not waited for a worker
            return Verdict.WAIT
        if time.monotonic() - waiting.since > self.config.no_worker_wait_s:
            await self.fail(waiting, "no_worker", decision.reason, 503)
            return Verdict.DROP
        return Verdict.WAIT

    def _place(self, request: GenerateRequest, workers: Sequence[WorkerInfo]) -> Decision:
        """The policy's decision, or the model's busy one of this pass again: every queue was full
        a decision ago, and this pass only adds to them (a response's later choices, which follow
        the first, do not come here)."""
        return self._busy.get((request.model, request.priority)) or self.policy.place(request, workers, self.local)

    async def dispatch(
        self, waiting: Waiting, request: GenerateRequest, placements: Sequence[Placement]
    ) -> DispatchOutcome:
        """Write the request's tasks; the outcome (RECOVERING, WORKER_GONE: nothing written, it waits)."""
        placing = spans.place(request, waiting.delivery.published_us) if tracing.on else None
        traceparent = "" if placing is None else placing.traceparent
        entry_id = waiting.delivery.entry_id
        try:
            outcome = await self.dispatcher.dispatch(entry_id, request, placements, self.config.name, traceparent)
        except BaseException as exc:  # Redis refused, a bug: the span must end all the same
            spans.not_placed(placing, exc)
            raise
        spans.placed(placing, outcome)
        if log.isEnabledFor(logging.DEBUG):  # per request: the placement list only when it is logged
            log.debug(
                "dispatch of %s (entry %s) to %s: outcome %d",
                request.request_id,
                waiting.delivery.entry_id,
                [p.worker.record.worker_id for p in placements],
                outcome,
            )
        if outcome is DispatchOutcome.NOT_OURS:
            log.info(
                "request entry %s is no longer this replica's (acked, or claimed by another): nothing written",
                waiting.delivery.entry_id,
            )
        metrics.DISPATCHES.labels(outcome.label).inc()
        if outcome is DispatchOutcome.DISPATCHED:
            self._dispatched(waiting, request)
        if outcome is DispatchOutcome.RECOVERING:
            self.recovery.begin()
        return outcome

    def _dispatched(self, waiting: Waiting, request: GenerateRequest) -> None:
        """Count a request's tasks written: its queue wait, and its tenant's served prompt tokens."""
        weight = self.weights.get(request.tenant, DEFAULT_WEIGHT)
        self.served.charge(request.tenant, len(request.prompt_token_ids), time.monotonic(), weight)
        if waiting.delivery.published_us is not None:
            metrics.QUEUE_WAIT.observe(max(0.0, time.time() - waiting.delivery.published_us / 1e6))

    def _reserve_locally(self, decision: Placed) -> None:
        for placement in decision.placements:
            self.ledger.reserve(placement)

    async def fail(self, waiting: Waiting, code: str, message: str, status: int) -> bool:
        """Fail the request to its client, if its entry is still ours (a replica that hung past
        its lease lost it to another, which decides) and the request is not dispatched (this
        entry is a copy, a retried XADD: the live run's client must not get the error)."""
        request = waiting.delivery.message
        settled = await self.dispatcher.settle_failed(waiting.delivery.entry_id, request.request_id, self.config.name)
        # a copy of a request dispatched (or failed) already: acked, nothing written
        if settled is SettleOutcome.DUPLICATE:
            log.info("request entry %s of %s: a duplicate, not failed", waiting.delivery.entry_id, request.request_id)
            metrics.DISPATCHES.labels(DispatchOutcome.DUPLICATE.label).inc()
        if settled is not SettleOutcome.FAIL_IT:
            return False
        log.warning("failing %s: %s", request.request_id, message)
        self.writer.fail(request.request_id, code, message, status, reader=request.reader)
        await self.writer.flush()
        await self.requests.ack(waiting.delivery.entry_id)
        metrics.DISPATCHES.labels(code).inc()
        return True

    async def follow_kv_events(self) -> None:
        """Apply the live workers' new KV events to the index (a blocking read of all their
        streams at once; a worker whose lease is gone is dropped from the index), each held to
        the blocks its record says it has."""
        alive = {w.record.worker_id: w.record.load.total_kv_blocks for w in self.view.workers if w.alive}
        if not alive:
            await asyncio.sleep(KV_EVENTS_BLOCK_MS / 1000)
        await self.kv_feeder.poll(alive, block_ms=KV_EVENTS_BLOCK_MS, capacities=alive)

    def routed(self, request: GenerateRequest, placements: Sequence[Placement]) -> None:
        """Tell the prefix view where a decision sends the request's prefill: its siblings follow."""
        for p in placements:
            if p.phase != Phase.DECODE:
                self.prefixes.routed(request, p.worker)

    async def read_weights(self) -> None:
        """The tenants' fair-share weights, from the tenant store (``splitbus tenants``); a record
        that does not read weighs 1 (the store says why, to whoever lists it)."""
        try:
            tenants = await self.tenants.all()
        except RedisError as exc:  # a forged key of another type (WRONGTYPE): the weights stay as they were
            if is_transient(exc):
                raise
            log.warning("the tenants' weights could not be read (%s); keeping the last ones", exc)
            return
        self.weights = {t.name: t.limits.weight for t in tenants if isinstance(t, Tenant)}

    async def trim_requests(self) -> None:
        """Delete request entries every replica has acked: the stream stays as long as its backlog."""
        await trim_requests(self.redis, self.config.bus.keys)

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

    async def claim_orphans(self) -> None:
        """Take over requests that a dead or hung replica read but never dispatched: at once
        when its lease is gone, after ``claim_idle_ms`` when it still holds its lease."""
        if self.recovery.recovering:
            return
        claimed = await self.claim_from_gone() + await self.requests.claim_idle()
        if claimed:
            now = time.monotonic()
            async with self._placing:  # kept in ``waiting`` first: a Redis error loses none of them
                self.waiting += [Waiting(d, now) for d in claimed]
                await self.place_waiting()

    async def reap_dead(self) -> None:
        """Move dead workers' tasks (not while recovering: a worker's lease may be lost with the
        rest, and it re-asserts what it holds)."""
        await self.recovery.check()  # a new run this loop has not seen yet: no move until it is settled
        if not self.recovery.recovering:
            await self.reaper.reap_dead()

    async def recover(self) -> None:
        """See a new Redis server run; once its grace is over, settle the cell and place again
        the entries pending with this replica that it does not hold: their dispatch was lost."""
        await self.recovery.check()
        if await self.recovery.step():
            await self.retake_pending()

    async def retake_pending(self) -> None:
        async with self._placing:
            lost = await self.requests.pending_ids() - {w.delivery.entry_id for w in self.waiting}
            if lost:
                log.warning(
                    "scheduler %s: %d request entr(ies) pending with it, not held: placing them",
                    self.config.name,
                    len(lost),
                )
                now = time.monotonic()
                self.waiting += [Waiting(d, now) for d in await self.requests.fetch(sorted(lost, key=entry_order))]
            await self.place_waiting()

    async def claim_from_gone(self) -> list[Delivery]:
        """The entries pending with replicas whose lease is gone; such a replica with nothing
        pending, idle past ``dead_consumer_keep_s``, is deleted from the group."""
        others = [c for c in await self.requests.consumers() if c.name != self.config.name]
        claimed: list[Delivery] = []
        for consumer, held in zip(others, await self.lease.held([c.name for c in others]), strict=True):
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
