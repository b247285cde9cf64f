"""The planner's core: once an interval, a reading of the fleet in, the advised prefill and
decode counts out, with their reasons (``Planner.step``). Pure: no Redis, no event loop, no
clock of its own (the reading carries the server's); ``splitbus.planner.service`` feeds it and
publishes what it decides, and ``splitbus bench planner`` runs it on simulated workers."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from splitbus.bus.roles import Role
from splitbus.planner.config import PlannerConfig
from splitbus.planner.fit import Line, Point, feedback_batch, fit_line, largest_met
from splitbus.planner.hysteresis import Stabilizer
from splitbus.planner.model import Backlog, Count, Reason, ceil, decode_count, grouped, kv_batch, prefill_count
from splitbus.planner.predictors import EWMA_ALPHA, PREDICTORS
from splitbus.planner.rates import Reading, Sample, WorkerReading, sample

__all__ = ["Decision", "Planner", "PlannerConfig", "Reading", "Reason", "Sizing", "WorkerReading"]

SIZED = (Role.PREFILL.value, Role.DECODE.value)
"""The roles the planner sizes; ``mixed`` workers are neither counted nor sized (a limit)."""


@dataclass(frozen=True)
class Sizing:
    """One role's advice."""

    desired: int
    """Workers wanted (after bounds and damping; DP ranks for a grouped role)."""
    groups: int
    """DP groups wanted (= ``desired`` for solo workers)."""
    actual: int
    """Live workers of the role, not draining."""
    draining: int
    """Live workers of the role that drain (take no new task)."""
    reason: Reason
    why: str = ""
    """The figures behind the count, for the log line."""

    def describe(self, role: str) -> str:
        return f"{role} {self.actual} -> {self.desired} ({self.why or self.reason.value})"


@dataclass(frozen=True)
class Decision:
    """One interval's advice, with what it was computed from."""

    at_s: float
    arrivals_rps: float
    """Measured over the interval that ended (0 at the first)."""
    predicted_rps: float
    """Expected over the next (the predictor's)."""
    prompt_tokens: float
    """Mean prompt length, tokens (0: not measured yet)."""
    hit_ratio: float
    """Share of prompt tokens served from the prefix cache."""
    output_tokens: float
    """Mean output length, tokens (0: not measured yet)."""
    prefill_tokens_per_s: float | None
    """Uncached prompt tokens a prefill worker computes per second; None before a measurement."""
    batch_at_slo: int | None
    """Requests per decode worker planned for (the ITL target's, or the KV cache's)."""
    prefill: Sizing
    decode: Sizing

    def describe(self) -> str:
        """The one-line why, for the log."""
        return f"{self.prefill.describe(Role.PREFILL.value)}; {self.decode.describe(Role.DECODE.value)}"

    def sizing(self, role: str) -> Sizing:
        return self.prefill if role == Role.PREFILL.value else self.decode


@dataclass
class _Measured:
    """The fleet's figures as measured so far: each an EWMA of the intervals that measured it."""

    prompt_tokens: float | None = None
    hit_ratio: float | None = None
    output_tokens: float | None = None
    prefill_rate: float | None = None
    blocks_per_request: float | None = None
    kv_blocks: int | None = None
    """The smallest decode worker's KV cache, blocks (the last seen)."""
    computed_tokens: int = 0
    busy_s: float = 0.0
    """Prefill work not yet in ``prefill_rate``: intervals add up until they hold ``min_busy_s``
    (short prompts, or a prefix cache that serves most of them, may take a few)."""

    def update(self, got: Sample, min_busy_s: float) -> None:
        for name in ("prompt_tokens", "hit_ratio", "output_tokens", "blocks_per_request"):
            setattr(self, name, _ewma(getattr(self, name), getattr(got, _SAMPLED.get(name, name))))
        self.kv_blocks = got.decode_kv_blocks if got.decode_kv_blocks is not None else self.kv_blocks
        self.computed_tokens += got.prefill_computed_tokens
        self.busy_s += got.prefill_busy_s
        if self.busy_s >= max(min_busy_s, 1e-6):
            self.prefill_rate = _ewma(self.prefill_rate, _prefill_rate(self.computed_tokens, self.busy_s))
            self.computed_tokens, self.busy_s = 0, 0.0

    @property
    def uncached_tokens(self) -> float | None:
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens * (1 - (self.hit_ratio or 0.0))


_SAMPLED = {"blocks_per_request": "kv_blocks_per_request"}


def _prefill_rate(computed_tokens: int, busy_s: float) -> float | None:
    """Uncached tokens per busy second; None when none were computed: busy time spent on prompts
    the prefix cache served whole (or counted a beat before their tokens) says nothing of the rate,
    and a rate of 0 would size prefill by dividing by it."""
    return computed_tokens / busy_s if computed_tokens > 0 else None


def _ewma(mean: float | None, value: float | None) -> float | None:
    if value is None:
        return mean
    return value if mean is None else EWMA_ALPHA * value + (1 - EWMA_ALPHA) * mean


class Planner:
    """Feeds on one reading an interval and advises the prefill and decode counts."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._predictor = PREDICTORS[config.predictor]()
        self._measured = _Measured()
        self._points: deque[Point] = deque(maxlen=config.fit_window)
        self._stable = {role: Stabilizer(config.scale_down_window_s) for role in SIZED}
        self._last: Reading | None = None
        self._batch: int | None = None

    def step(self, reading: Reading) -> Decision:
        """The advice at ``reading``; the first call measures (``Reason.MEASURING``)."""
        before, self._last = self._last, reading
        got = None if before is None else sample(before, reading, self.config.min_decode_steps)
        if got is not None:
            self._predictor.observe(got.arrivals_rps)
            self._measured.update(got, self.config.min_busy_s)
            self._points.extend(got.decode_points)
        rps = self._predictor.predict()
        prefill = self._size(reading, Role.PREFILL.value, self._prefill(reading, got, rps))
        decode = self._size(reading, Role.DECODE.value, self._decode(reading, got, rps))
        m = self._measured
        return Decision(
            at_s=reading.at_s,
            arrivals_rps=got.arrivals_rps if got else 0.0,
            predicted_rps=rps,
            prompt_tokens=m.prompt_tokens or 0.0,
            hit_ratio=m.hit_ratio or 0.0,
            output_tokens=m.output_tokens or 0.0,
            prefill_tokens_per_s=m.prefill_rate,
            batch_at_slo=self._batch,
            prefill=prefill,
            decode=decode,
        )

    def _prefill(self, reading: Reading, got: Sample | None, rps: float) -> Count:
        actual = _actual(reading, Role.PREFILL.value)
        floor = max(actual, 1 if rps > 0 else 0)
        uncached, rate = self._measured.uncached_tokens, self._measured.prefill_rate
        if _no_prompts(reading, got, rps):
            return Count(0, Reason.SLO, "slo: no demand: none predicted or queued")  # whatever was measured
        if got is None or uncached is None or rate is None:
            return Count(floor, Reason.MEASURING)
        queued = got.queued_prefill_tokens + (reading.unread + reading.held) * uncached
        c = self.config
        backlog = Backlog(queued, actual, c.start_delay_s)
        count = prefill_count(rps, uncached, rate, c.prefill_budget_s, c.target_utilization, backlog)
        if count.reason is Reason.SLO_UNREACHABLE:
            return Count(actual, count.reason, count.why)
        return Count(floor, count.reason, count.why) if count.reason is Reason.MEASURING else count

    def _decode(self, reading: Reading, got: Sample | None, rps: float) -> Count:
        actual = _actual(reading, Role.DECODE.value)
        floor = max(actual, 1 if rps > 0 else 0)
        line = fit_line(self._points)
        by_itl = self._batch_at_itl(line, got)
        if line is not None and by_itl == 0:
            self._batch = None
            why = f"a step takes {line.a * 1000:.1f} ms with no request in it"
            return Count(actual, Reason.SLO_UNREACHABLE, why)
        by_kv = kv_batch(self._measured.kv_blocks, self._blocks_per_request(reading))
        self._batch = _smallest(by_itl, by_kv)
        if _idle(got, rps):
            return Count(0, Reason.SLO, "slo: no demand: none predicted, running or queued")
        output = self._measured.output_tokens
        if got is None or output is None:
            return Count(floor, Reason.MEASURING if output is None else Reason.HELD)
        return self._decode_sized(rps, output, got.decode_running, line, (by_itl, by_kv), floor)

    def _decode_sized(
        self,
        rps: float,
        output: float,
        running: int,
        line: Line | None,
        bounds: tuple[int | None, int | None],
        floor: int,
    ) -> Count:
        """Decode workers at the batch planned for; with no batch at the ITL target, a rise by the
        KV cache's batch, else ``_decode_below``."""
        by_itl, by_kv = bounds
        batch = self._batch
        itl_s = line.itl_s(batch) if line is not None and batch else self.config.itl_slo_s
        count = decode_count(rps, output, batch, itl_s, running) if batch else None
        if count is None or (by_itl is None and count.workers <= floor):  # no batch, or only the KV cache's
            return self._decode_below(rps, output, running, by_kv, floor, count)
        return _decode_reason(count, by_itl, by_kv)

    def _decode_below(
        self, rps: float, output: float, running: int, by_kv: int | None, floor: int, count: Count | None
    ) -> Count:
        """Without a batch at the ITL target, a count no higher than the current one: the largest
        mean batch in the window that met the target is a lower bound for it, so the count it needs
        is at least what the fleet needs (a fall to it is safe); held without such a batch."""
        met = largest_met(self._points, self.config.itl_slo_s * self.config.itl_headroom)
        if met is not None:
            batch = _smallest(math.floor(met.batch), by_kv) or 1
            low = decode_count(rps, output, batch, met.itl_s, running)
            if low.workers < floor:
                return Count(low.workers, low.reason, f"{low.why} (batch {batch} met the ITL target)")
        why = f"; {count.why}" if count is not None else ""
        return Count(floor, Reason.HELD, f"held: no batch at the ITL target measured to size by{why}")

    def _batch_at_itl(self, line: Line | None, got: Sample | None) -> int | None:
        if line is not None:
            return line.batch_at(self.config.itl_slo_s * self.config.itl_headroom)
        return feedback_batch(got.decode_points, self.config.itl_slo_s) if got is not None else None

    def _blocks_per_request(self, reading: Reading) -> float | None:
        """The mean KV blocks a decode request holds: as measured, else from the mean lengths."""
        m = self._measured
        if m.blocks_per_request is not None:
            return m.blocks_per_request
        sizes = [w.block_size for w in reading.of_role(Role.DECODE.value)]
        if m.prompt_tokens is None or m.output_tokens is None or not sizes:
            return None
        return float(ceil((m.prompt_tokens + m.output_tokens) / max(sizes)))

    def _size(self, reading: Reading, role: str, count: Count) -> Sizing:
        workers = reading.of_role(role)
        dp_size = max((w.dp_size for w in workers), default=1)
        if not workers and not self._measured_role(role):
            count = self._unread(role)
        bounded = min(max(count.workers, self.config.min_workers), self.config.max_workers)
        raw, _ = self._grouped(bounded, dp_size)
        desired = self._stable[role].settle(reading.at_s, raw)
        if desired > raw:
            count = Count(raw, Reason.HELD, f"held: {raw} computed, {desired} kept for the scale-down window")
        desired, groups = self._grouped(desired, dp_size)
        draining = sum(1 for w in workers if w.load.draining)
        return Sizing(desired, groups, len(workers) - draining, draining, count.reason, count.why)

    def _measured_role(self, role: str) -> bool:
        """Whether anything of ``role``'s workers was measured: the prefill rate, decode's points."""
        return self._measured.prefill_rate is not None if role == Role.PREFILL.value else bool(self._points)

    def _unread(self, role: str) -> Count:
        """A role with no reading yet (none of its workers registered, nothing measured: the first
        intervals after a start): the count advised last, else the least; 0 running is no reading."""
        last = self._stable[role].desired
        why = f"measuring: no {role} worker registered yet"
        return Count(self.config.min_workers if last is None else last, Reason.MEASURING, why)

    def _grouped(self, workers: int, dp_size: int) -> tuple[int, int]:
        """(workers, groups) in whole DP groups, rounded up, then down to whole groups within the
        most advised (rounding up past it would make an advice its readers refuse)."""
        rounded, groups = grouped(workers, dp_size)
        if rounded <= self.config.max_workers:
            return rounded, groups
        return grouped(self.config.max_workers // max(dp_size, 1) * max(dp_size, 1), dp_size)


def _actual(reading: Reading, role: str) -> int:
    return sum(1 for w in reading.of_role(role) if not w.load.draining)


def _no_prompts(reading: Reading, got: Sample | None, rps: float) -> bool:
    """Whether prefill has no demand at all: none predicted, none queued at a worker or unplaced."""
    return got is not None and rps <= 0 and got.queued_prefill_tokens == 0 and not reading.unread + reading.held


def _idle(got: Sample | None, rps: float) -> bool:
    """Whether decode has no demand at all: none predicted, and none running or queued now."""
    return got is not None and rps <= 0 and got.decode_held == 0


def _smallest(by_itl: int | None, by_kv: int | None) -> int | None:
    """The batch a decode worker is planned for: the smaller known bound, at least one request."""
    known = [batch for batch in (by_itl, by_kv) if batch is not None]
    return max(min(known), 1) if known else None


def _decode_reason(count: Count, by_itl: int | None, by_kv: int | None) -> Count:
    """The decode count's reason: the KV cache's when it bounds the batch."""
    kv_bound = by_kv is not None and (by_itl is None or by_kv < by_itl)
    reason = Reason.KV_BOUND if kv_bound and count.reason is Reason.SLO else count.reason
    return Count(count.workers, reason, count.why)
