"""The serving benchmark's workload and its statistics: the seeded Poisson trace, how one request
went (``RequestResult``), sending a trace at its arrival times, and vLLM's serving-benchmark
fields over the results.

Both ways ``splitbus bench serve`` measures share it: over HTTP (``serve``) and the sim engine
driven in-process (``serve_direct``). It lives apart from both so that neither imports the other
to get it (``serve`` runs ``serve_direct``; the reverse would be an import cycle).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
FIRST_TOKEN_ID, LAST_TOKEN_ID = 32, 126
"""Prompt token ids are drawn from here: printable bytes, present in any byte-level vocabulary."""


@dataclass(frozen=True)
class ServeConfig:
    rates: tuple[float, ...] = (10.0, 25.0, 50.0)
    """Requests per second of the Poisson arrivals, one run each; ``inf`` sends all at once."""
    num_prompts: int = 200
    max_concurrency: int = 512
    input_len: int = 128
    output_len: int = 64
    len_range: float = 0.5
    """Lengths are uniform in [len * (1 - range), len * (1 + range)]."""
    model: str = "tiny"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError("rates must be > 0 (inf: all at once)")
        if min(self.num_prompts, self.max_concurrency, self.input_len, self.output_len) < 1:
            raise ValueError("num_prompts, max_concurrency, input_len and output_len must be >= 1")
        if not 0 <= self.len_range < 1:
            raise ValueError("len_range must be in [0, 1)")


@dataclass(frozen=True)
class TraceItem:
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int


def make_trace(config: ServeConfig, rate: float) -> list[TraceItem]:
    """Seeded: the same config and rate give the same requests at the same times."""
    rng = np.random.default_rng(config.seed)
    n = config.num_prompts
    gaps = np.zeros(n) if math.isinf(rate) else rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    inputs = _lengths(rng, config.input_len, config.len_range, n)
    outputs = _lengths(rng, config.output_len, config.len_range, n)
    return [
        TraceItem(float(a), rng.integers(FIRST_TOKEN_ID, LAST_TOKEN_ID + 1, i).tolist(), int(o))
        for a, i, o in zip(arrivals, inputs, outputs, strict=True)
    ]


def _lengths(rng: np.random.Generator, mean: int, spread: float, n: int) -> np.ndarray:
    return rng.integers(max(1, int(mean * (1 - spread))), int(mean * (1 + spread)) + 1, n)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its send."""

    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    error: str = ""


async def replay(
    send: Callable[[TraceItem], Any], trace: list[TraceItem], max_concurrency: int, progress: Any = None
) -> tuple[list[RequestResult], float]:
    """Send the trace at its arrival times, at most ``max_concurrency`` at once; returns the
    results and the run's duration."""
    gate = asyncio.Semaphore(max_concurrency)
    start = time.perf_counter()

    async def one(item: TraceItem) -> RequestResult:
        await asyncio.sleep(max(0.0, item.arrival_s - (time.perf_counter() - start)))
        async with gate:
            result = await send(item)
        if progress is not None:
            progress.update(1)
        return result

    results = await asyncio.gather(*(one(item) for item in trace))
    return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """vLLM's serving-benchmark fields, from the client's view of each request."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
    }
    tpot = [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    series = {
        "ttft": [r.ttft_s for r in done],
        "tpot": tpot,
        "itl": [g for r in done for g in r.itl_s],
        "e2el": [r.e2el_s for r in done],
    }
    for name, values in series.items():
        summary.update(_stats(name, values))
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def _stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    """Mean, median, std and percentiles in ms; None when nothing was measured (JSON null,
    not NaN)."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", *(f"p{p}_{name}_ms" for p in PERCENTILES)]
    if not seconds:
        return dict.fromkeys(keys)
    ms = np.array(seconds) * 1000
    values = [np.mean(ms), np.median(ms), np.std(ms), *(np.percentile(ms, p) for p in PERCENTILES)]
    return {k: float(v) for k, v in zip(keys, values, strict=True)}


def cdf_samples(results: list[RequestResult], points: int = 200) -> dict[str, list[float]]:
    """Quantiles of TTFT, ITL and E2EL in ms, for the plot's CDFs (the JSON stays small)."""
    done = [r for r in results if r.ok]
    series = {
        "ttft": [r.ttft_s for r in done],
        "itl": [g for r in done for g in r.itl_s],
        "e2el": [r.e2el_s for r in done],
    }
    qs = np.linspace(0, 100, points)
    return {k: (np.percentile(np.array(v) * 1000, qs).round(3).tolist() if v else []) for k, v in series.items()}
