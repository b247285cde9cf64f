"""What the fleet did between two readings of the registry: arrivals, prompt and output lengths,
the prefix hit ratio, the prefill rate per worker and each decode worker's batch and step time
(``Sample``), from the growth of the workers' cumulative counters (``WorkerLoad``).

A counter counts only for a worker in both readings; one that went back (a restart) counts
nothing, as a new worker does (``counter_growth``). A worker that does not report a counter (an
older version reads 0) gives no measurement of what that counter measures."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from splitbus.bus.records import Reserved, WorkerLoad, counter_growth
from splitbus.bus.roles import Role
from splitbus.planner.fit import Point

STARTING = (Role.PREFILL.value, Role.MIXED.value)
"""The roles whose workers start requests: their queues are arrivals not started yet."""


@dataclass(frozen=True)
class WorkerReading:
    """One live worker as the registry shows it."""

    worker_id: str
    role: str
    """``prefill``, ``decode`` or ``mixed`` (``splitbus.bus.roles``)."""
    dp_size: int
    """Ranks in its DP group; 1 for a solo worker."""
    block_size: int
    load: WorkerLoad
    reserved: Reserved


@dataclass(frozen=True)
class Reading:
    """The fleet at one instant."""

    at_s: float
    """The Redis server's clock, seconds: intervals are measured on one clock."""
    workers: tuple[WorkerReading, ...]
    """The live workers, draining ones included (``load.draining`` 1)."""
    unread: int
    """Requests in the request stream no scheduler has read."""
    held: int
    """Requests a scheduler read and has not placed yet."""

    def of_role(self, role: str) -> list[WorkerReading]:
        return [w for w in self.workers if w.role == role]


@dataclass(frozen=True)
class Sample:
    """The fleet over one interval; None where the interval measured nothing of it."""

    dt_s: float
    arrivals_rps: float
    """Requests started per second, plus the growth of those waiting to start (``λ``)."""
    prompt_tokens: float | None
    """Mean prompt length of the requests prefilled (``L``)."""
    hit_ratio: float | None
    """Share of those prompt tokens the prefix cache served (``h``)."""
    output_tokens: float | None
    """Mean output length, the first token (prefill's) included (``O``)."""
    prefill_computed_tokens: int
    """Prompt tokens the prefill workers computed (not cached) over the interval."""
    prefill_busy_s: float
    """Their time inside prefill calls over the interval: with the tokens, the rate ``μ``."""
    decode_points: tuple[Point, ...]
    """Each decode worker's mean batch and step time, where it ran enough steps."""
    kv_blocks_per_request: float | None
    """Mean KV blocks a running decode request holds now (``k̄``)."""
    decode_kv_blocks: int | None
    """The smallest KV cache of the decode workers now, in blocks."""
    queued_prefill_tokens: int
    """Prompt tokens queued or reserved at the prefilling workers now."""
    decode_held: int
    """Requests running, waiting or reserved at the decode workers now (any: decode has demand)."""
    decode_running: int
    """Requests decoding at the decode workers now: those waiting there wait for their KV, most of
    them still queued at prefill (a decode worker reserves their blocks at placement)."""


def sample(before: Reading, now: Reading, min_steps: int) -> Sample | None:
    """The interval from ``before`` to ``now``; None when it has no length (the same reading)."""
    dt_s = now.at_s - before.at_s
    if dt_s <= 0:
        return None
    grown = _Growth(before, now)
    prompts, cached = grown("prompt_tokens_done"), grown("prompt_tokens_cached")
    return Sample(
        dt_s=dt_s,
        arrivals_rps=max(0.0, (grown("prefills_done") + _waiting(now) - _waiting(before)) / dt_s),
        prompt_tokens=_ratio(prompts, grown("prefills_done", _reporting(now, "prompt_tokens_done"))),
        hit_ratio=_ratio(cached, prompts),
        output_tokens=_output_tokens(grown, now),
        **_prefill_work(grown, now),
        decode_points=tuple(_points(grown, now, min_steps)),
        kv_blocks_per_request=_kv_per_request(now),
        decode_kv_blocks=min(_kv_caches(now), default=None),
        queued_prefill_tokens=sum(
            w.load.queued_prefill_tokens + w.reserved.reserved_prefill_tokens for w in _starting(now)
        ),
        decode_held=sum(_held(w) for w in now.of_role(Role.DECODE.value)),
        decode_running=sum(w.load.running for w in now.of_role(Role.DECODE.value)),
    )


class _Growth:
    """The counters' growth between two readings, over all workers or some."""

    def __init__(self, before: Reading, now: Reading) -> None:
        self._before = {w.worker_id: w.load for w in before.workers}
        self._now = {w.worker_id: w.load for w in now.workers}

    def __call__(self, name: str, ids: Collection[str] | None = None) -> int:
        return counter_growth(_column(self._before, name, ids), _column(self._now, name, ids))


def _column(loads: Mapping[str, WorkerLoad], name: str, ids: Collection[str] | None) -> dict[str, int]:
    return {worker: getattr(load, name) for worker, load in loads.items() if ids is None or worker in ids}


def _reporting(reading: Reading, name: str, role: str | None = None) -> set[str]:
    """The workers (of ``role``) whose ``name`` counter is running (an older worker's reads 0)."""
    return {w.worker_id for w in reading.workers if getattr(w.load, name) > 0 and role in (None, w.role)}


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _starting(reading: Reading) -> list[WorkerReading]:
    return [w for w in reading.workers if w.role in STARTING]


def _waiting(reading: Reading) -> int:
    """Requests arrived and not started: unplaced, or waiting at a worker that prefills."""
    queued = sum(w.load.waiting + w.reserved.reserved_requests for w in _starting(reading))
    return reading.unread + reading.held + queued


def _held(worker: WorkerReading) -> int:
    return worker.load.running + worker.load.waiting + worker.reserved.reserved_requests


def _output_tokens(grown: _Growth, now: Reading) -> float | None:
    decoders = _reporting(now, "decode_tokens_done", Role.DECODE.value)
    per_request = _ratio(grown("decode_tokens_done", decoders), grown("decodes_done", decoders))
    return None if per_request is None else per_request + 1  # the first token is the prefill's


def _prefill_work(grown: _Growth, now: Reading) -> dict[str, Any]:
    """The prefill workers' computed tokens and busy time (those that report busy time only)."""
    prefillers = _reporting(now, "prefill_busy_us", Role.PREFILL.value)
    computed = grown("prompt_tokens_done", prefillers) - grown("prompt_tokens_cached", prefillers)
    return {"prefill_computed_tokens": max(computed, 0), "prefill_busy_s": grown("prefill_busy_us", prefillers) / 1e6}


def _points(grown: _Growth, now: Reading, min_steps: int) -> list[Point]:
    found = []
    for worker in now.of_role(Role.DECODE.value):
        one = {worker.worker_id}
        steps = grown("decode_steps", one)
        if steps >= min_steps:
            found.append(Point(grown("decode_tokens_done", one) / steps, grown("decode_time_us", one) / 1e6 / steps))
    return found


def _kv_caches(now: Reading) -> list[int]:
    """The decode workers' KV caches, blocks (an engine that reports none reads 0: left out)."""
    return [w.load.total_kv_blocks for w in now.of_role(Role.DECODE.value) if w.load.total_kv_blocks > 0]


def _kv_per_request(now: Reading) -> float | None:
    per_request = [
        (w.load.total_kv_blocks - w.load.free_kv_blocks) / w.load.running
        for w in now.of_role(Role.DECODE.value)
        if w.load.running > 0
    ]
    return sum(per_request) / len(per_request) if per_request else None
