"""``splitbus bench stagger``: naive vs staggered DP scheduling on the same seeded Poisson trace.

Two backends: real rank processes (``splitbus up --engine sim --dp 4``, requests through the
HTTP API, idle forwards read from the ranks' registry records) and the discrete-event
simulation (``stagger_sim``) for 8, 16 and 64 ranks, which runs the same scheduling code.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from splitbus.bench.stagger_sim import GroupSimulation, TraceRequest, poisson_trace
from splitbus.bench.system import LocalSystem
from splitbus.bus.keys import Keys
from splitbus.worker.config import SimConfig

SIM_LOADS = {"low": 2.0, "moderate": 20.0, "high": 24.0}
"""Arrivals per second per rank for the simulation's cost model (the sim engine's defaults):
about 8 %, 80 % and 95 % of the rate at which naive scheduling saturates."""
PROCESS_COST_SCALE = 4.0
"""The rank processes run the sim engine this many times slower, at this many times fewer
arrivals: the same load, relative to the group's capacity, as the simulation's, at a request
rate that 2 shared cores keep up with (4 ranks, an API, a scheduler, Redis and the client)."""
PROCESS_LOADS = {load: rate / PROCESS_COST_SCALE for load, rate in SIM_LOADS.items()}
WINDOW_SWEEP = (0.25, 0.5, 1.0, 2.0)
"""Window lengths, in steps of the group, that the simulation compares at moderate load."""
MODES = ("naive", "staggered")
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

    def __post_init__(self) -> None:
        if any(r < 1 for r in self.sim_ranks) or self.process_ranks < 0:
            raise ValueError("--sim-ranks must be >= 1 and --process-ranks >= 0")
        if self.duration_s <= 0 or self.process_duration_s <= 0:
            raise ValueError("--duration and --process-duration must be positive")


class EmptyTrace(Exception):
    """A trace drew no arrivals: there is nothing to measure."""


def _trace(rate_per_s: float, duration_s: float, seed: int, what: str) -> list[TraceRequest]:
    trace = poisson_trace(rate_per_s, duration_s, seed)
    if not trace:
        raise EmptyTrace(f"the {what} trace drew no requests in {duration_s:g} s; give it a longer duration")
    return trace


def scaled_costs(scale: float) -> SimConfig:
    base = SimConfig()
    return SimConfig(base.prefill_s_per_token * scale, base.decode_step_s * scale, base.decode_s_per_seq * scale)


def simulate(ranks: int, load: str, trace: list[TraceRequest], seed: int, cost_scale: float = 1.0) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        r = GroupSimulation(ranks, staggered=mode == "staggered", seed=seed, costs=scaled_costs(cost_scale)).run(trace)
        rows.append(_row("simulation", ranks, load, mode, cost_scale, Counters(r.idle_forward_ratio, r.idle_time_ratio, r.step_utilization),
                         r.ttft_p50_s, r.ttft_p99_s, r.throughput_tok_s, r.requests))
    return rows


def sweep_window(ranks: int, trace: list[TraceRequest], seed: int) -> list[dict[str, Any]]:
    """Staggered runs of one trace with windows of different lengths (in steps of the group)."""
    rows = []
    for steps in WINDOW_SWEEP:
        r = GroupSimulation(ranks, staggered=True, seed=seed, steps_held=steps).run(trace)
        rows.append({"ranks": ranks, "load": "moderate", "steps_held": steps, "idle_forward_ratio": round(r.idle_forward_ratio, 4),
                     "ttft_p50_s": round(r.ttft_p50_s, 4), "ttft_p99_s": round(r.ttft_p99_s, 4), "throughput_tok_s": round(r.throughput_tok_s, 1)})
    return rows


@dataclass(frozen=True)
class Counters:
    idle_forward_ratio: float
    """Idle forwards per rank-step."""
    idle_time_ratio: float
    """Share of the ranks' step time spent in idle forwards."""
    step_utilization: float
    """Share of the ranks' step time spent computing their own prefill or decode."""


def _row(backend: str, ranks: int, load: str, mode: str, cost_scale: float, counters: Counters, p50: float, p99: float, tput: float, requests: int) -> dict[str, Any]:
    return {"backend": backend, "ranks": ranks, "load": load, "mode": mode, "cost_scale": cost_scale, **{k: round(v, 4) for k, v in asdict(counters).items()},
            "ttft_p50_s": round(p50, 4), "ttft_p99_s": round(p99, 4), "throughput_tok_s": round(tput, 1), "requests": requests}


class _System(LocalSystem):
    """``splitbus up --engine sim --dp N``, naive or staggered."""

    def __init__(self, ranks: int, staggered: bool, costs: SimConfig) -> None:
        naive = ["--scheduler-arg=--no-stagger", "--worker-arg=--dp-align-ms", "--worker-arg=0"]
        cost_args = {"--sim-prefill-us-per-token": costs.prefill_s_per_token * 1e6, "--sim-decode-step-ms": costs.decode_step_s * 1e3,
                     "--sim-decode-us-per-seq": costs.decode_s_per_seq * 1e6}
        worker_args = [f"--worker-arg={a}" for flag, value in cost_args.items() for a in (flag, f"{value:g}")]
        super().__init__("--engine", "sim", "--dp", str(ranks), *worker_args, *([] if staggered else naive))

    def counters(self) -> np.ndarray:
        """The ranks' cumulative step counters (``RANK_COUNTERS``) summed, as their heartbeats
        report them."""
        import redis

        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        total = np.zeros(len(RANK_COUNTERS))
        keys = Keys()  # the system the benchmark started uses the default prefix
        for worker in client.zrange(keys.workers, 0, -1):
            total += [int(v or 0) for v in client.hmget(keys.worker(worker), *RANK_COUNTERS)]
        client.close()
        return total


async def _replay(base_url: str, trace: list[TraceRequest]) -> tuple[list[float], int, float]:
    """Send the trace through the API at its arrival times; TTFTs, tokens and seconds taken."""
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120,
                                http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1000)))
    start = time.perf_counter()

    async def one(req: TraceRequest) -> tuple[float, int]:
        await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - start)))
        sent = time.perf_counter()
        stream = await client.completions.create(model="tiny", prompt=[97] * req.prompt_tokens, max_tokens=req.output_tokens, stream=True)
        first, tokens = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter() - sent
                tokens += len(chunk.choices[0].text)
        return first or 0.0, tokens

    results = await asyncio.gather(*(one(r) for r in trace))
    elapsed = time.perf_counter() - start
    await client.close()
    return [r[0] for r in results], sum(r[1] for r in results), elapsed


def run_processes(ranks: int, duration_s: float, seed: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Naive and staggered with real rank processes, then the simulation of the same traces and
    costs: the check that the model predicts the processes."""
    traces = {load: _trace(rate * ranks, duration_s, seed, f"{load}-load process") for load, rate in PROCESS_LOADS.items()}
    rows = []
    for mode in MODES:
        system = _System(ranks, mode == "staggered", scaled_costs(PROCESS_COST_SCALE))
        try:
            for load, trace in traces.items():
                progress(f"processes: {ranks} ranks, {mode}, {load} load ({PROCESS_LOADS[load] * ranks:.1f} req/s)")
                rows.append(_measure(system, ranks, load, mode, trace))
        finally:
            system.stop()
    for load, trace in traces.items():
        rows += simulate(ranks, load, trace, seed, PROCESS_COST_SCALE)
    return rows


def _measure(system: _System, ranks: int, load: str, mode: str, trace: list[TraceRequest]) -> dict[str, Any]:
    time.sleep(1.0)  # let the last load's steps settle into the counters
    before = system.counters()
    ttfts, tokens, elapsed = asyncio.run(_replay(f"http://127.0.0.1:{system.port}/v1", trace))
    time.sleep(1.0)  # heartbeats publish the counters every 0.5 s
    steps, idle, step_us, idle_us, busy_us = system.counters() - before
    counters = Counters(idle / max(steps, 1), idle_us / max(step_us, 1), busy_us / max(step_us, 1))
    return _row("processes", ranks, load, mode, PROCESS_COST_SCALE, counters, float(np.percentile(ttfts, 50)), float(np.percentile(ttfts, 99)), tokens / elapsed, len(trace))


def run_stagger_bench(config: StaggerBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    results, sweep = [], []
    if config.process_ranks:
        results += run_processes(config.process_ranks, config.process_duration_s, config.seed, progress)
    for ranks in config.sim_ranks:
        for load, rate in SIM_LOADS.items():
            progress(f"simulation: {ranks} ranks, {load} load")
            trace = _trace(rate * ranks, config.duration_s, config.seed, f"{load}-load simulated")
            results += simulate(ranks, load, trace, config.seed)
            if load == "moderate":
                sweep += sweep_window(ranks, trace, config.seed)
    return {"seed": config.seed, "duration_s": config.duration_s, "process_duration_s": config.process_duration_s, "sim_loads_per_rank": SIM_LOADS,
            "process_loads_per_rank": PROCESS_LOADS, "process_cost_scale": PROCESS_COST_SCALE, "results": results, "window_sweep": sweep}
