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
DATASETS = ("random", "prefix", "multiturn", "trace")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Workload:
    """What ``--dataset`` generates; only the fields of the chosen dataset are used."""

    dataset: str = "random"
    """One of ``DATASETS``; ``random`` is the Poisson trace of ``serve_trace.make_trace``."""
    prefix_groups: int = 8
    """prefix: groups, each with its own shared prefix."""
    prefix_len: int = 512
    """prefix: tokens of each group's shared prefix."""
    questions_per_group: int = 8
    """prefix: requests per group, each the prefix and its own question."""
    question_len: int = 64
    """prefix: tokens of each question."""
    conversations: int = 8
    """multiturn: conversations, started at the Poisson arrival times."""
    turns: int = 4
    """multiturn: turns per conversation, each sent when the previous one's answer is complete."""
    turn_len: int = 64
    """multiturn: new user tokens per turn (the prompt is the history and these)."""
    trace_file: str | None = None
    """trace: the Mooncake JSONL file."""
    time_scale: float = 1.0
    """trace: arrival times are multiplied by this (0.5 replays twice as fast)."""
    block_size: int = 16
    """Tokens per KV block for the ideal hit ratio (the worker's default block size)."""
    system_len: int = 0
    """multiturn: tokens of each conversation's own system prompt, before its first turn (a long
    first prompt, then short follow-ups: where conditional disaggregation matters)."""

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}")
        counts = (self.prefix_groups, self.questions_per_group, self.question_len, self.conversations, self.turns)
        if min(*counts, self.turn_len, self.block_size) < 1 or min(self.prefix_len, self.system_len) < 0:
            raise ValueError("workload counts and lengths must be >= 1 (prefix_len and system_len >= 0)")
        if self.dataset == "trace" and not self.trace_file:
            raise ValueError("--dataset trace needs a trace file")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError("time_scale must be > 0")


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
    workload: Workload = Workload()
    """``--dataset`` and its settings (``random``: the lengths above, at Poisson times)."""
    goodput: tuple[tuple[str, float], ...] = ()
    """``--goodput``'s bounds, (metric, ms): ``request_goodput`` counts the requests that meet all."""
    policies: tuple[str, ...] = ()
    """``--policy``: scheduler policies to compare, each ``MODE[:ARG...]`` (the scheduler's
    ``--mode`` and extra arguments), one ``splitbus up`` each on the same requests; empty: the
    comparison with the engine driven directly."""
    up_args: tuple[str, ...] = ()
    """``--up-arg``: extra arguments of the ``splitbus up`` that ``policies`` start (the workers)."""
    dispatch: tuple[str, ...] = ("scheduler",)
    """``--dispatch``: who places requests in the comparison with the engine driven directly, one
    ``splitbus up`` each, side by side (``scheduler``, ``api``: ``splitbus up --dispatch``)."""

    def __post_init__(self) -> None:
        # In two halves (each check in the order it always ran: the first failure is the one reported).
        self._check_dispatch_and_sizes()
        self._check_workload()

    def _check_dispatch_and_sizes(self) -> None:
        if not self.dispatch or any(d not in ("scheduler", "api") for d in self.dispatch):
            raise ValueError("dispatch modes are scheduler and api")
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError("rates must be > 0 (inf: all at once)")
        if min(self.num_prompts, self.max_concurrency, self.input_len, self.output_len) < 1:
            raise ValueError("num_prompts, max_concurrency, input_len and output_len must be >= 1")

    def _check_workload(self) -> None:
        if not 0 <= self.len_range < 1:
            raise ValueError("len_range must be in [0, 1)")
        if any(name not in GOODPUT_METRICS or not (math.isfinite(ms) and ms > 0) for name, ms in self.goodput):
            raise ValueError(f"goodput bounds are ({'|'.join(GOODPUT_METRICS)}, ms > 0)")
        if any(not p.split(":")[0] for p in self.policies):
            raise ValueError("a policy is MODE[:ARG...]")


@dataclass(frozen=True)
class TraceItem:
    arrival_s: float
    """Seconds from the run's start; ignored for an item that ``follows`` another."""
    prompt_token_ids: list[int]
    max_tokens: int
    follows: int | None = None
    """The index of an earlier item whose answer this one waits for (a conversation's previous
    turn), or None: sent at ``arrival_s``."""


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
    cached_tokens: int = 0
    """Prompt tokens the server reused from its prefix cache (``usage.prompt_tokens_details.
    cached_tokens``; 0 when it does not say)."""


async def replay(
    send: Callable[[TraceItem], Any], trace: list[TraceItem], max_concurrency: int, progress: Any = None
) -> tuple[list[RequestResult], float]:
    """Send the trace at its arrival times, at most ``max_concurrency`` at once; returns the
    results and the run's duration."""
    gate = asyncio.Semaphore(max_concurrency)
    answered = [asyncio.Event() for _ in trace]
    start = time.perf_counter()

    async def one(index: int, item: TraceItem) -> RequestResult:
        if item.follows is None:
            await asyncio.sleep(max(0.0, item.arrival_s - (time.perf_counter() - start)))
        else:
            await answered[item.follows].wait()
        async with gate:
            result = await send(item)
        answered[index].set()
        if progress is not None:
            progress.update(1)
        return result

    if any(item.follows is not None and not 0 <= item.follows < i for i, item in enumerate(trace)):
        raise ValueError("an item can only follow an earlier one")
    results = await asyncio.gather(*(one(i, item) for i, item in enumerate(trace)))
    return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None) -> dict[str, Any]:
    """vLLM's serving-benchmark fields, from the client's view of each request, with
    ``request_goodput`` (requests/s that met every bound of ``slos``, ms by metric; None without
    bounds, as vLLM) and the prefix hit ratio (cached prompt tokens / prompt tokens)."""
    done = [r for r in results if r.ok]
    in_tokens, out_tokens, cached = _token_totals(done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s,
        "request_goodput": _goodput(done, slos, duration_s),
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "total_cached_tokens": cached,
        "prefix_hit_ratio": cached / in_tokens if in_tokens else 0.0,
    }
    for name, values in _series(done).items():
        summary.update(_stats(name, values))
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def _token_totals(done: list[RequestResult]) -> tuple[int, int, int]:
    """Prompt, output and cached prompt tokens of the completed requests."""
    return (
        sum(r.prompt_tokens for r in done),
        sum(r.output_tokens for r in done),
        sum(r.cached_tokens for r in done),
    )


def _goodput(done: list[RequestResult], slos: dict[str, float] | None, duration_s: float) -> float | None:
    """Requests/s that met every bound; None without bounds (as vLLM)."""
    return sum(meets_slos(r, slos) for r in done) / duration_s if slos else None


def _series(done: list[RequestResult]) -> dict[str, list[float]]:
    """Each latency's values, seconds: TTFT, TPOT (of requests with two tokens or more), ITL, E2EL."""
    return {
        "ttft": [r.ttft_s for r in done],
        "tpot": [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [g for r in done for g in r.itl_s],
        "e2el": [r.e2el_s for r in done],
    }


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


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """vLLM's goodput test: every given bound met (TTFT, TPOT over the tokens after the first,
    end-to-end latency; <= the bound in ms)."""
    tpot = (result.e2el_s - result.ttft_s) / (result.output_tokens - 1) if result.output_tokens > 1 else 0.0
    measured = {"ttft": result.ttft_s, "tpot": tpot, "e2el": result.e2el_s}
    return result.ok and all(measured[name] * 1000 <= bound for name, bound in slos.items())
