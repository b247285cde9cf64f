"""The planner's arithmetic, one formula a function (docs/planner.md, "Formulas"): the prefill
workers that start the predicted arrivals within the TTFT target, the decode batch that meets
the ITL target and the decode workers that hold the predicted concurrency at that batch. Plain
numbers in, a count and its reason out."""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitbus.bus.planner import Reason

KV_USE_MAX = 0.9
"""The share of a decode worker's KV blocks its batch may be planned to hold."""
_EPSILON = 1e-9
"""Slack for ``ceil``: 2.0000000001 workers computed from decimal inputs are 2."""


@dataclass(frozen=True)
class Count:
    """A role's count as computed, before bounds and damping."""

    workers: int
    reason: Reason
    why: str = ""
    """The figures behind it, for the log line."""


def ceil(value: float) -> int:
    return max(math.ceil(value - _EPSILON), 0)


def utilization(service_s: float, budget_s: float, target: float) -> float | None:
    """The busiest a prefill worker may be so that a prompt's wait and service fit ``budget_s``
    (M/D/1: ``W = ρs/(2(1−ρ))``, ``s + W ≤ S`` gives ``ρ ≤ 2(S − s)/(2S − s)``), at most ``target``;
    None when one prompt's service alone takes the budget."""
    if service_s >= budget_s:
        return None
    return min(target, 2 * (budget_s - service_s) / (2 * budget_s - service_s))


@dataclass(frozen=True)
class Backlog:
    """The prompts waiting to be prefilled now, and what clears them until more workers come."""

    tokens: float
    """Uncached prompt tokens queued, reserved or not placed yet."""
    serving: int = 0
    """Prefill workers serving now (not draining)."""
    start_delay_s: float = 0.0
    """From asking for a worker to its first prefill (``PlannerConfig.start_delay_s``)."""


def prefill_count(
    rps: float, uncached_tokens: float, rate: float, budget_s: float, target: float, backlog: Backlog
) -> Count:
    """Prefill workers for ``rps`` prompts of ``uncached_tokens`` at ``rate`` tokens/s each, and
    for the ``backlog`` left when workers asked now come (``backlog_workers``); measuring while no
    rate above 0 is known (every rate divides by it) and there is demand: with none predicted or
    queued, no worker is needed whatever the rate (an idle fleet falls to its minimum)."""
    if rps <= 0 and backlog.tokens <= 0:
        return Count(0, Reason.SLO, "slo: no prompt predicted or queued")
    if rate <= 0:
        return Count(0, Reason.MEASURING, "measuring: no prefill rate above 0 tokens/s yet")
    service_s = uncached_tokens / rate
    rho = utilization(service_s, budget_s, target)
    if rho is None:
        why = f"one prompt takes {service_s:.3f} s of a {budget_s:.3f} s budget"
        return Count(0, Reason.SLO_UNREACHABLE, why)
    by_rate = ceil(rps * uncached_tokens / (rate * rho))
    by_backlog, left = backlog_workers(rps * uncached_tokens, rate, budget_s, backlog)
    if by_backlog > by_rate:
        why = (
            f"backlog: {backlog.tokens:.0f} tokens queued, {left:.0f} left when a worker asked now comes"
            f" (in {backlog.start_delay_s:.0f} s); cleared within {max(backlog.start_delay_s, budget_s):.2f} s"
            f" at {rate:.0f} tok/s per worker"
        )
        return Count(by_backlog, Reason.BACKLOG, why)
    rates = f"{rps:.1f} req/s predicted x {uncached_tokens:.0f} uncached tokens / {rate:.0f} tok/s per worker"
    return Count(max(by_rate, 1 if rps > 0 else 0), Reason.SLO, f"slo: {rates} at rho {rho:.2f}")


def backlog_workers(demand_tokens_s: float, rate: float, budget_s: float, backlog: Backlog) -> tuple[int, float]:
    """(workers, tokens left): the prefill workers that clear the backlog still there when a worker
    asked now comes, while serving ``demand_tokens_s``. A worker comes ``d`` = ``start_delay_s``
    after the ask, so it cannot help with what the ``serving`` workers clear before then, nor with
    the requests that waited past their target meanwhile: the backlog it finds is ``B = Q +
    (demand - serving x rate) x d``; none (0 workers) when that is not above 0, or when nothing is
    queued now (``Q`` = 0: the serving workers keep up so far, and a backlog projected from the
    predicted rate alone would multiply the predictor's error by ``d``). What is left is
    cleared within ``H = max(d, budget_s)``: ``(demand + B / H) / rate`` workers. With workers that
    come at once (``d`` = 0) that is the TTFT budget; otherwise one more start delay, so that the
    misses it causes are at most twice those the start delay makes
    unavoidable, with workers of the order of the rate's (a horizon of the budget would ask for
    ``d / budget_s`` times as many, each paid a start delay for seconds of work)."""
    d = backlog.start_delay_s
    left = backlog.tokens + (demand_tokens_s - backlog.serving * rate) * d
    if backlog.tokens <= 0 or left <= 0:
        return 0, 0.0
    return ceil((demand_tokens_s + left / max(d, budget_s)) / rate), left


def kv_batch(total_blocks: int | None, blocks_per_request: float | None) -> int | None:
    """The requests a decode worker's KV cache holds at ``KV_USE_MAX``; None if unknown."""
    if total_blocks is None or blocks_per_request is None or blocks_per_request <= 0:
        return None
    return math.floor(KV_USE_MAX * total_blocks / blocks_per_request)


def decode_count(rps: float, output_tokens: float, batch: int, itl_s: float, running: int) -> Count:
    """Decode workers for the concurrency of ``rps`` requests of ``output_tokens`` each at
    ``itl_s`` a token (Little's law: ``C = λ·O·itl``), ``batch`` per worker, and for the
    requests decoding now. Only those: a request placed on a decode worker waits there for its KV
    while it is queued at prefill, and its decode demand is already in ``C`` (counting it too
    sized decode for a prefill backlog, with no request to decode)."""
    concurrency = rps * output_tokens * itl_s
    by_rate, by_running = ceil(concurrency / batch), ceil(running / batch)
    if by_running > by_rate:
        return Count(by_running, Reason.BACKLOG, f"backlog: {running} requests running / batch {batch}")
    figures = f"{rps:.1f} req/s x {output_tokens:.0f} tokens x {itl_s * 1000:.1f} ms = {concurrency:.1f} running"
    why = f"slo: {figures} / batch {batch}"
    return Count(max(by_rate, 1 if rps > 0 else 0), Reason.SLO, why)


def grouped(workers: int, dp_size: int) -> tuple[int, int]:
    """(workers, DP groups) for ``workers`` ranks of groups of ``dp_size``: whole groups."""
    groups = ceil(workers / max(dp_size, 1))
    return groups * max(dp_size, 1), groups
