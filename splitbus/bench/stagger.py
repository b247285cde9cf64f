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

SIM_LOADS = {"low": 2.0, "moderate": 20.0, "high": 24.0}
"""Arrivals per second per rank for the simulation's cost model (the sim engine's defaults):
about 8 %, 80 % and 95 % of the rate at which naive scheduling saturates."""
PROCESS_LOADS = {"low": 1.0, "moderate": 5.0, "high": 8.0}
"""Lower for real processes: 4 ranks, an API, a scheduler, Redis and the client share 2 cores."""
MODES = ("naive", "staggered")
RANK_COUNTERS = ("steps", "idle_forwards", "step_time_us", "idle_time_us", "busy_time_us")


def simulate(ranks: int, load: str, duration_s: float, seed: int) -> list[dict[str, Any]]:
    trace = poisson_trace(SIM_LOADS[load] * ranks, duration_s, seed)
    rows = []
    for mode in MODES:
        r = GroupSimulation(ranks, staggered=mode == "staggered", seed=seed).run(trace)
        rows.append(_row("simulation", ranks, load, mode, Counters(r.idle_forward_ratio, r.idle_time_ratio, r.step_utilization), r.ttft_p50_s, r.ttft_p99_s, r.throughput_tok_s, r.requests))
    return rows


@dataclass(frozen=True)
class Counters:
    idle_forward_ratio: float
    """Idle forwards per rank-step."""
    idle_time_ratio: float
    """Share of the ranks' step time spent in idle forwards."""
    step_utilization: float
    """Share of the ranks' step time spent computing their own prefill or decode."""


def _row(backend: str, ranks: int, load: str, mode: str, counters: Counters, p50: float, p99: float, tput: float, requests: int) -> dict[str, Any]:
    return {"backend": backend, "ranks": ranks, "load": load, "mode": mode, **{k: round(v, 4) for k, v in asdict(counters).items()},
            "ttft_p50_s": round(p50, 4), "ttft_p99_s": round(p99, 4), "throughput_tok_s": round(tput, 1), "requests": requests}


class _System(LocalSystem):
    """``splitbus up --engine sim --dp N``, naive or staggered."""

    def __init__(self, ranks: int, staggered: bool) -> None:
        naive = ["--scheduler-arg=--no-stagger", "--worker-arg=--dp-align-ms", "--worker-arg=0"]
        super().__init__("--engine", "sim", "--dp", str(ranks), *([] if staggered else naive))

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
    rows = []
    for mode in MODES:
        system = _System(ranks, staggered=mode == "staggered")
        try:
            for load, rate in PROCESS_LOADS.items():
                progress(f"processes: {ranks} ranks, {mode}, {load} load ({rate * ranks:.0f} req/s)")
                rows.append(_measure(system, ranks, load, mode, poisson_trace(rate * ranks, duration_s, seed)))
        finally:
            system.stop()
    return rows


def _measure(system: _System, ranks: int, load: str, mode: str, trace: list[TraceRequest]) -> dict[str, Any]:
    time.sleep(1.0)  # let the last load's steps settle into the counters
    before = system.counters()
    ttfts, tokens, elapsed = asyncio.run(_replay(f"http://127.0.0.1:{system.port}/v1", trace))
    time.sleep(1.0)  # heartbeats publish the counters every 0.5 s
    steps, idle, step_us, idle_us, busy_us = system.counters() - before
    counters = Counters(idle / max(steps, 1), idle_us / max(step_us, 1), busy_us / max(step_us, 1))
    return _row("processes", ranks, load, mode, counters, float(np.percentile(ttfts, 50)), float(np.percentile(ttfts, 99)), tokens / elapsed, len(trace))


def run_stagger_bench(sim_ranks: list[int], process_ranks: int, duration_s: float, seed: int, progress: Callable[[str], None]) -> dict[str, Any]:
    results = []
    if process_ranks:
        results += run_processes(process_ranks, duration_s, seed, progress)
    for ranks in sim_ranks:
        for load in SIM_LOADS:
            progress(f"simulation: {ranks} ranks, {load} load")
            results += simulate(ranks, load, duration_s, seed)
    return {"seed": seed, "duration_s": duration_s, "sim_loads_per_rank": SIM_LOADS, "process_loads_per_rank": PROCESS_LOADS, "results": results}
