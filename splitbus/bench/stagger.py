"""``splitbus bench stagger``: naive vs staggered DP scheduling on the same seeded Poisson trace.

Two backends: real rank processes (``splitbus up --engine sim --dp 4``, requests through the
HTTP API, idle forwards read from the ranks' registry records) and the discrete-event
simulation (``stagger_sim``) for 8, 16 and 64 ranks, which runs the same scheduling code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, cast

import numpy as np

from splitbus.bench.stagger_sim import NO_EP, GroupSimulation, TraceRequest, poisson_trace
from splitbus.bench.system import LocalSystem
from splitbus.bus.core.keys import Keys
from splitbus.worker.engines.sim import SimConfig

SIM_LOADS = {"low": 2.0, "moderate": 20.0, "high": 24.0}
"""Arrivals per second per rank for the simulation's cost model (the sim engine's defaults):
about 8 %, 80 % and 95 % of the rate at which naive scheduling saturates."""
PROCESS_COST_SCALE = 4.0
"""The rank processes run the sim engine this many times slower, at this many times fewer
arrivals: the same load, relative to the group's capacity, as the simulation's, at a request
rate that 2 shared cores keep up with (4 ranks, an API, a scheduler, Redis and the client)."""
PROCESS_LOADS = {load: rate / PROCESS_COST_SCALE for load, rate in SIM_LOADS.items()}
MAX_WAIT_S = 0.5
ALIGN_MS = 0.0
"""The defaults of ``--stagger-max-wait-ms`` and ``--dp-align-ms``; scaled with the costs."""
MODES = ("naive", "staggered")
LETTERS = (97, 123)
"""The token ids of the replayed prompts' letters, ``a`` to ``z`` (the old prompts' one token was ``a``)."""
RANK_COUNTERS = ("steps", "idle_forwards", "step_time_us", "idle_time_us", "busy_time_us")


@dataclass(frozen=True)
class StaggerBenchConfig:
    sim_ranks: tuple[int, ...] = (8, 16, 64)
    process_ranks: int = 4
    """Rank processes to start (0: none)."""
    duration_s: float = 6.0
    """Seconds of arrivals per simulated trace."""
    process_duration_s: float = 10.0
    """Seconds of arrivals per trace sent to the rank processes."""
    seed: int = 1
    process_repeats: int = 3
    """Runs of each trace per mode on the rank processes: one run's TTFT p50 moves by about
    ±7 % from run to run on 2 shared cores, as much as the effect measured."""

    def __post_init__(self) -> None:
        if any(r < 1 for r in self.sim_ranks) or self.process_ranks < 0 or self.process_repeats < 1:
            raise ValueError("--sim-ranks and --process-repeats must be >= 1 and --process-ranks >= 0")
        if self.duration_s <= 0 or self.process_duration_s <= 0:
            raise ValueError("--duration and --process-duration must be positive")


class EmptyTrace(Exception):
    """A trace drew no arrivals: there is nothing to measure."""


def _trace(rate_per_s: float, duration_s: float, seed: int, what: str) -> list[TraceRequest]:
    trace = poisson_trace(rate_per_s, duration_s, seed)
    if not trace:
        raise EmptyTrace(f"the {what} trace drew no requests in {duration_s:g} s; give it a longer duration")
    return trace


def scaled_costs(scale: float, base: SimConfig = NO_EP) -> SimConfig:
    """``base``'s costs, every one ``scale`` times longer (by default the sim engine's without
    the EP all-to-all, as this benchmark's published tables were measured)."""
    times = ("prefill_s_per_token", "decode_step_s", "decode_s_per_seq", "a2a_s", "a2a_s_per_token")
    return replace(base, **{name: getattr(base, name) * scale for name in times})


def simulate(
    ranks: int, load: str, trace: list[TraceRequest], seed: int, cost_scale: float = 1.0
) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        r = GroupSimulation(
            ranks,
            staggered=mode == "staggered",
            seed=seed,
            costs=scaled_costs(cost_scale),
            max_wait_s=MAX_WAIT_S * cost_scale,
            align_ms=ALIGN_MS * cost_scale,
        ).run(trace)
        rows.append(
            _row(
                "simulation",
                ranks,
                load,
                mode,
                cost_scale,
                Counters(r.idle_forward_ratio, r.idle_time_ratio, r.step_utilization, r.idle_forward_ratio_all_steps),
                r.ttft_p50_s,
                r.ttft_p99_s,
                r.throughput_tok_s,
                r.requests,
            )
        )
    return rows


@dataclass(frozen=True)
class Counters:
    idle_forward_ratio: float
    """Idle forwards per rank-step."""
    idle_time_ratio: float
    """Share of the ranks' step time spent in idle forwards."""
    step_utilization: float
    """Share of the ranks' step time spent computing their own prefill or decode."""
    idle_forward_ratio_all_steps: float
    """Idle forwards per rank-step, the drain after the last arrival included (the others count
    the steps that start by the last arrival)."""

    @classmethod
    def of(cls, by_last_arrival: np.ndarray, all_steps: np.ndarray) -> Counters:
        """From the ranks' summed counters (``RANK_COUNTERS``)."""
        steps, idle, step_us, idle_us, busy_us = by_last_arrival
        return cls(
            idle / max(steps, 1),
            idle_us / max(step_us, 1),
            busy_us / max(step_us, 1),
            all_steps[1] / max(all_steps[0], 1),
        )


def _row(
    backend: str,
    ranks: int,
    load: str,
    mode: str,
    cost_scale: float,
    counters: Counters,
    p50: float,
    p99: float,
    tput: float,
    requests: int,
) -> dict[str, Any]:
    return {
        "backend": backend,
        "ranks": ranks,
        "load": load,
        "mode": mode,
        "cost_scale": cost_scale,
        **{k: round(v, 4) for k, v in asdict(counters).items()},
        "ttft_p50_s": round(p50, 4),
        "ttft_p99_s": round(p99, 4),
        "throughput_tok_s": round(tput, 1),
        "requests": requests,
    }


class _System(LocalSystem):
    """``splitbus up --engine sim --dp N`` (or the ``topology`` given), naive or staggered."""

    def __init__(
        self,
        ranks: int,
        staggered: bool,
        cost_scale: float,
        base: SimConfig = NO_EP,
        topology: tuple[str, ...] = (),
        max_wait_s: float = MAX_WAIT_S,
    ) -> None:
        costs = scaled_costs(cost_scale, base)
        worker = {
            "--sim-prefill-us-per-token": costs.prefill_s_per_token * 1e6,
            "--sim-decode-step-ms": costs.decode_step_s * 1e3,
            "--sim-decode-us-per-seq": costs.decode_s_per_seq * 1e6,
            "--sim-ep-a2a-ms": costs.a2a_s * 1e3,
            "--sim-ep-a2a-us-per-token": costs.a2a_s_per_token * 1e6,
            "--dp-align-ms": ALIGN_MS * cost_scale if staggered else 0,
        }
        scheduler = {"--stagger-max-wait-ms": max_wait_s * 1e3 * cost_scale} if staggered else {"--no-stagger": None}
        args = [f"--worker-arg={a}" for flag, value in worker.items() for a in (flag, f"{value:g}")]
        args += [
            f"--scheduler-arg={a}"
            for flag, value in scheduler.items()
            for a in (flag, *([] if value is None else [f"{value:g}"]))
        ]
        super().__init__("--engine", "sim", *(topology or ("--dp", str(ranks))), *args)

    def counters(self, role: str | None = None) -> np.ndarray:
        """The ranks' cumulative step counters (``RANK_COUNTERS``) summed, as the ranks report
        them with every step plan; only the ranks of ``role`` when given."""
        import redis

        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        total = np.zeros(len(RANK_COUNTERS))
        keys = Keys()  # the system the benchmark started uses the default prefix
        for worker in cast("list[str]", client.zrange(keys.workers, 0, -1)):  # the client decodes replies
            values = cast("list[str | None]", client.hmget(keys.worker(worker), "role", *RANK_COUNTERS))
            if role is None or values[0] == role:
                total += [int(v or 0) for v in values[1:]]
        client.close()
        return total


@dataclass(frozen=True)
class Replayed:
    """One trace sent through the API."""

    ttfts: list[float]
    tpots: list[float]
    """Seconds per output token after the first, of each request with more than one."""
    tokens: int
    elapsed_s: float
    at_last_arrival: Any
    """What the callback returned as the last request went out."""
    failed: list[str]
    """Why each request that got no complete answer failed (the others' numbers are above)."""
    client_lag_s: float = 0.0
    """The client's own event-loop lag, at its worst: how late a 50 ms tick woke. Over a second,
    the client was starved of CPU, and what it measured includes its own delay (and an API's
    header deadline may have closed connections it was too slow to write a request on)."""


async def _replay(
    base_url: str,
    trace: list[TraceRequest],
    at_last_arrival: Callable[[], Any],
    prompt_of: Callable[[TraceRequest, int], list[int]] | None = None,
) -> Replayed:
    """Send the trace through the API at its arrival times; TTFTs, TPOTs, tokens, seconds taken,
    and what ``at_last_arrival`` returned as the last request went out. ``prompt_of``: request
    ``i``'s prompt (default: ``distinct_prompt``, which a sim engine reads only for its length
    and its prefix cache)."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=base_url,
        api_key="x",
        max_retries=0,
        timeout=120,
        # The Limits class of the httpx openai is built on (httpx or httpx2, by openai's version).
        http_client=openai.DefaultAsyncHttpxClient(limits=type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=1000)),
    )
    start = time.perf_counter()

    async def one(req: TraceRequest, index: int) -> tuple[float, int, float | None] | str:
        progress = [0.0, 0]  # seconds since sent, tokens received: where a failure happened
        try:
            return await stream(req, index, progress)
        except openai.APIError as exc:  # counted and reported: one failure does not void the run
            return failure(exc, progress)

    async def stream(req: TraceRequest, index: int, progress: list[Any]) -> tuple[float, int, float | None]:
        await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - start)))
        sent = time.perf_counter()
        progress[0] = sent
        prompt = prompt_of(req, index) if prompt_of else distinct_prompt(req, index)
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=req.output_tokens, stream=True)
        first, last, tokens = None, 0.0, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter() - sent
                first = first or last
                tokens += len(chunk.choices[0].text)
                progress[1] = tokens
        tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
        return first or 0.0, tokens, tpot

    async def snapshot() -> Any:
        await asyncio.sleep(max(0.0, trace[-1].arrival_s - (time.perf_counter() - start)))
        return await asyncio.to_thread(at_last_arrival)

    meter = LagMeter()
    lag = asyncio.ensure_future(meter.run())
    results, counters = await asyncio.gather(asyncio.gather(*(one(r, i) for i, r in enumerate(trace))), snapshot())
    elapsed = time.perf_counter() - start
    lag.cancel()
    await client.close()
    answered = [r for r in results if not isinstance(r, str)]
    tpots = [r[2] for r in answered if r[2] is not None]
    failed = [r for r in results if isinstance(r, str)]
    return Replayed(
        [r[0] for r in answered], tpots, sum(r[1] for r in answered), elapsed, counters, failed, meter.worst_s
    )


def distinct_prompt(req: TraceRequest, index: int) -> list[int]:
    """The prompt sent for a trace's ``index``-th request: ``prompt_tokens`` random letters, seeded
    by the index and the arrival time, so no two requests of a trace, or of the traces one
    system replays in turn, share a prefix (a block of 16 letters matches by chance with odds of
    26^-16). The prompts used to be one token repeated: every prompt was a prefix of the longer
    ones, and cache-aware placement (issue 23) sent nearly every request to the one rank that
    held the longest run of it (docs/benchmarks.md, ``bench ep``)."""
    rng = np.random.default_rng([index, int(req.arrival_s * 1e9)])
    return [int(t) for t in rng.integers(LETTERS[0], LETTERS[1], req.prompt_tokens)]


class LagMeter:
    """How late the client's event loop wakes a ``tick_s`` sleep, at worst, while ``run`` runs."""

    def __init__(self, tick_s: float = 0.05) -> None:
        self.tick_s, self.worst_s = tick_s, 0.0

    async def run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.tick_s)
            self.worst_s = max(self.worst_s, time.perf_counter() - before - self.tick_s)


def failure(exc: BaseException, progress: list[Any]) -> str:
    """What a failed request says: the client's error, the transport error under it (openai's
    "Connection error." alone names no cause), when it failed and how many tokens it had got."""
    cause = exc.__cause__ or exc.__context__
    under = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    since = f"{time.perf_counter() - progress[0]:.1f}s after sending" if progress[0] else "before sending"
    return f"{type(exc).__name__}: {exc}{under}, {since}, {progress[1]} tokens in"


@dataclass
class ProcessRuns:
    """One mode and load on the rank processes, summed over the repeats."""

    ttfts: list[float] = field(default_factory=list)
    run_p50s: list[float] = field(default_factory=list)
    counters: np.ndarray = field(default_factory=lambda: np.zeros(len(RANK_COUNTERS)))
    """Moved by each run's last arrival."""
    all_counters: np.ndarray = field(default_factory=lambda: np.zeros(len(RANK_COUNTERS)))
    """Moved by each whole run, the drain included."""
    tokens: int = 0
    elapsed_s: float = 0.0

    def add(
        self, ttfts: list[float], counters: np.ndarray, all_counters: np.ndarray, tokens: int, elapsed_s: float
    ) -> None:
        self.ttfts += ttfts
        self.run_p50s.append(float(np.percentile(ttfts, 50)))
        self.counters += counters
        self.all_counters += all_counters
        self.tokens, self.elapsed_s = self.tokens + tokens, self.elapsed_s + elapsed_s

    def row(self, ranks: int, load: str, mode: str, requests: int) -> dict[str, Any]:
        """TTFT percentiles of every repeat's requests pooled; counters and throughput over all."""
        row = _row(
            "processes",
            ranks,
            load,
            mode,
            PROCESS_COST_SCALE,
            Counters.of(self.counters, self.all_counters),
            float(np.percentile(self.ttfts, 50)),
            float(np.percentile(self.ttfts, 99)),
            self.tokens / self.elapsed_s,
            requests,
        )
        return {**row, "runs_ttft_p50_s": [round(p, 4) for p in self.run_p50s]}


def run_processes(
    ranks: int, duration_s: float, seed: int, repeats: int, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Naive and staggered with real rank processes, each trace ``repeats`` times per mode (the
    modes take turns going first), then the simulation of the same traces and costs: the check
    that the model predicts the processes."""
    traces = {
        load: _trace(rate * ranks, duration_s, seed, f"{load}-load process") for load, rate in PROCESS_LOADS.items()
    }
    runs = {(mode, load): ProcessRuns() for mode in MODES for load in traces}
    for repeat in range(repeats):
        for mode in MODES[::-1] if repeat % 2 else MODES:
            _run_mode(ranks, mode, traces, runs, _run_progress(progress, ranks, mode, repeat, repeats))
    rows = [runs[(mode, load)].row(ranks, load, mode, len(trace)) for mode in MODES for load, trace in traces.items()]
    for load, trace in traces.items():
        rows += simulate(ranks, load, trace, seed, PROCESS_COST_SCALE)
    return rows


def _run_progress(
    progress: Callable[[str], None], ranks: int, mode: str, repeat: int, repeats: int
) -> Callable[[str], None]:
    """What one run of ``mode`` says as it starts each load (bound here, not to the loop's variables)."""
    return lambda load: progress(
        f"processes: {ranks} ranks, {mode}, {load} load "
        f"({PROCESS_LOADS[load] * ranks:.1f} req/s), run {repeat + 1} of {repeats}"
    )


def _run_mode(
    ranks: int,
    mode: str,
    traces: dict[str, list[TraceRequest]],
    runs: dict[tuple[str, str], ProcessRuns],
    progress: Callable[[str], None],
) -> None:
    system = _System(ranks, mode == "staggered", PROCESS_COST_SCALE)
    try:
        for load, trace in traces.items():
            progress(load)
            runs[(mode, load)].add(*_measure(system, trace))
    finally:
        system.stop()


def _measure(system: _System, trace: list[TraceRequest]) -> tuple[list[float], np.ndarray, np.ndarray, int, float]:
    """Replay one trace: its TTFTs, the ranks' counters it moved by its last arrival (as the
    simulation counts them; see ``GroupSimulation.arrivals_end``) and in all, its tokens and
    seconds."""
    time.sleep(1.0)  # let the last load's drain settle into the counters
    before = system.counters()
    done = asyncio.run(_replay(f"http://127.0.0.1:{system.port}/v1", trace, system.counters))
    if done.failed:
        raise RuntimeError(f"{len(done.failed)} requests failed, the first: {done.failed[0]}")
    time.sleep(1.0)  # the last steps' counters reach the registry
    return done.ttfts, done.at_last_arrival - before, system.counters() - before, done.tokens, done.elapsed_s


def run_stagger_bench(config: StaggerBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    results = []
    if config.process_ranks:
        results += run_processes(
            config.process_ranks, config.process_duration_s, config.seed, config.process_repeats, progress
        )
    for ranks in config.sim_ranks:
        for load, rate in SIM_LOADS.items():
            progress(f"simulation: {ranks} ranks, {load} load")
            trace = _trace(rate * ranks, config.duration_s, config.seed, f"{load}-load simulated")
            results += simulate(ranks, load, trace, config.seed)
    return {
        "seed": config.seed,
        "duration_s": config.duration_s,
        "process_duration_s": config.process_duration_s,
        "process_repeats": config.process_repeats,
        "sim_loads_per_rank": SIM_LOADS,
        "process_loads_per_rank": PROCESS_LOADS,
        "process_cost_scale": PROCESS_COST_SCALE,
        "results": results,
    }
