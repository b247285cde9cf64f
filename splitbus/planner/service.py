"""The planner's shell: every interval it reads the registry and the request stream's backlog,
steps the core, and publishes the advice (``sb:planner:{cell}``), its gauges, and one log line
when an advised count changes. It only advises: nothing here starts or stops a worker. A Redis
error, or any error deciding, skips the interval (logged); the next one measures over both."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect
from splitbus.bus.core.errors import BusError
from splitbus.bus.planner import Advice, publish
from splitbus.bus.registry import Registry, Snapshot, WorkerInfo
from splitbus.bus.request_stream import Unplaced, unplaced_requests
from splitbus.bus.roles import ROLES
from splitbus.planner import metrics
from splitbus.planner.config import PlannerConfig
from splitbus.planner.core import Decision, Planner, Reading, WorkerReading

log = logging.getLogger(__name__)

SKIPPED = (RedisError, BusError, OSError)
"""What a Redis round trip may raise that skips one interval rather than ending the planner."""


class PlannerService:
    """``splitbus planner``: the core fed from Redis once an interval."""

    def __init__(self, bus: BusConfig, config: PlannerConfig, redis: aioredis.Redis | None = None) -> None:
        self.bus, self.config = bus, config
        self._own_client = redis is None
        self._redis = redis if redis is not None else connect(bus, max_connections=4, name="planner")
        self._registry = Registry(self._redis, bus)
        self._planner = Planner(config)
        self._last: Decision | None = None
        self.stopping = asyncio.Event()
        self.exit_code = 0

    async def run(self) -> None:
        """Plan every interval until ``stopping`` is set."""
        log.info("planner: advising every %.1f s (predictor %s)", self.config.interval_s, self.config.predictor)
        try:
            while not self.stopping.is_set():
                await self.tick()
                await self._sleep()
        finally:
            if self._own_client:
                await self._redis.aclose()

    async def _sleep(self) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), self.config.interval_s)

    async def tick(self) -> Decision | None:
        """One interval: read, decide, publish. None when reading or deciding failed (the interval skipped)."""
        try:
            reading = await self._read()
        except SKIPPED as exc:
            log.warning("planner: skipping an interval, reading Redis failed: %.200s", exc)
            return None
        decided = self._decide(reading)
        if decided is None:
            return None
        decision, advised = decided
        try:
            await publish(self._redis, self.bus.keys, advised)
        except SKIPPED as exc:
            log.warning("planner: could not publish the advice: %.200s", exc)
        self._show(decision, reading)
        return decision

    def _decide(self, reading: Reading) -> tuple[Decision, Advice] | None:
        """The core's decision and its advice; None when computing them failed. Any error: a
        figure no test foresaw must cost one interval, not the planner (which then advises
        nothing, and the advice key expires)."""
        try:
            decision = self._planner.step(reading)
            return decision, advice(decision, self.config)
        except Exception:
            log.exception("planner: skipping an interval, deciding failed")
            return None

    def _show(self, decision: Decision, reading: Reading) -> None:
        """The gauges and the log line; an error in them is logged, the advice stands."""
        try:
            metrics.show(decision, reading, self._last)
            self._say(decision)
        except Exception:
            log.exception("planner: could not show the decision")
        self._last = decision

    async def _read(self) -> Reading:
        snapshot = await self._registry.snapshot_at()
        unplaced = await unplaced_requests(self._redis, self.bus.keys)
        return reading_of(snapshot, unplaced, self.config.model)

    def _say(self, decision: Decision) -> None:
        """The log line, only when an advised count changed (and at the first decision)."""
        counts = (decision.prefill.desired, decision.decode.desired)
        if self._last is None or counts != (self._last.prefill.desired, self._last.decode.desired):
            log.info("planner: %s", decision.describe())


def reading_of(snapshot: Snapshot, unplaced: Unplaced, model: str = "") -> Reading:
    """The core's reading of a registry snapshot: the live workers (of ``model``, "" any)."""
    workers = tuple(
        _worker(info)
        for info in snapshot.workers
        if info.alive and info.record.role in ROLES and model in ("", info.record.model)
    )
    return Reading(snapshot.server_ms / 1000, workers, unplaced.unread, unplaced.held)


def _worker(info: WorkerInfo) -> WorkerReading:
    record = info.record
    return WorkerReading(
        record.worker_id, record.role, max(record.dp_size, 1), record.block_size, record.load, info.reserved
    )


def advice(decision: Decision, config: PlannerConfig) -> Advice:
    """The decision as the bus carries it."""
    p, d = decision.prefill, decision.decode
    return Advice(
        at_ms=round(decision.at_s * 1000),
        interval_ms=max(round(config.interval_s * 1000), 1),
        predictor=config.predictor,
        arrivals_rps=decision.arrivals_rps,
        predicted_rps=decision.predicted_rps,
        prompt_tokens=decision.prompt_tokens,
        hit_ratio=decision.hit_ratio,
        output_tokens=decision.output_tokens,
        prefill_tokens_per_s=decision.prefill_tokens_per_s,
        batch_at_slo=decision.batch_at_slo,
        desired_prefill=p.desired,
        desired_decode=d.desired,
        groups_prefill=p.groups,
        groups_decode=d.groups,
        actual_prefill=p.actual,
        actual_decode=d.actual,
        draining_prefill=p.draining,
        draining_decode=d.draining,
        reason_prefill=p.reason,
        reason_decode=d.reason,
    )
