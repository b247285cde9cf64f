"""``splitbus bench ep``: naive vs staggered prefill placement in EP + PD (a prefill DP group and a
decode DP group) on the same seeded Poisson trace, under the sim engine's EP cost model.

Two backends: the discrete-event simulation (``ep_sim``) with groups of 8, 16 and 64 ranks, and
real processes (``splitbus up --engine sim --prefill 1 --prefill-dp 4 --decode 1 --decode-dp 4``,
costs and loads scaled as ``bench stagger`` scales them, several runs per mode pooled). Trace
generation, process orchestration and the replay are ``bench stagger``'s.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from splitbus.bench.ep_sim import EpResult, EpSimulation
from splitbus.bench.stagger import (
    ALIGN_MS,
    MAX_WAIT_S,
    MODES,
    PROCESS_COST_SCALE,
    RANK_COUNTERS,
    EmptyTrace,
    _replay,
    _System,
    _trace,
    scaled_costs,
)
from splitbus.bench.stagger_sim import TraceRequest
from splitbus.bus.roles import Role
from splitbus.worker.engines.sim import SimConfig

__all__ = ["EmptyTrace", "EpBenchConfig", "run_ep_bench"]

SIM_LOADS = {"low": 2.0, "moderate": 20.0, "high": 28.0}
"""Arrivals per second per prefill rank under the EP cost model (``SimConfig()``): about 7 %,
70 % and 95 % of the rate at which naive placement saturates the prefill group (TTFT p50 grows
without bound past ~30 a rank; the decode group of as many ranks keeps up with all three)."""
PROCESS_LOADS = {load: rate / PROCESS_COST_SCALE for load, rate in SIM_LOADS.items()}
IDLE_FORWARD_S = scaled_costs(PROCESS_COST_SCALE, SimConfig()).forward_s("idle", 0)
"""What one idle forward of a process rank computes (sleeps): the scaled sim engine's."""
BACKENDS = ("simulation", "processes")
ROW_FIELDS = (
    "backend",
    "ranks",
    "load",
    "mode",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "prefill_idle_forward_ratio",
    "decode_idle_forward_ratio",
    "prefill_idle_compute_s",
    "decode_idle_compute_s",
    "decode_step_imbalance",
    "output_throughput",
)
"""Every ``results[]`` row has these (and ``cost_scale``, ``requests``)."""


@dataclass(frozen=True)
class EpBenchConfig:
    backends: tuple[str, ...] = BACKENDS
    sim_ranks: tuple[int, ...] = (8, 16, 64)
    """Ranks of the simulated prefill group and of the decode group."""
    process_ranks: int = 4
    duration_s: float = 6.0
    """Seconds of arrivals per simulated trace."""
    process_duration_s: float = 10.0
    runs: int = 3
    """Runs of each trace per mode on the processes, pooled."""
    loads: tuple[str, ...] = tuple(SIM_LOADS)
    seed: int = 1
    max_wait_s: float = MAX_WAIT_S
    """The stagger window's bound (``--stagger-max-wait-ms``), before the costs' scale: the
    scheduler's default unless a run compares another."""

    def __post_init__(self) -> None:
        # In two halves (each check in the order it always ran: the first failure is the one reported).
        self._check_backends_and_counts()
        self._check_durations_and_loads()

    def _check_backends_and_counts(self) -> None:
        if not self.backends or any(b not in BACKENDS for b in self.backends):
            raise ValueError(f"--backend must be one of {BACKENDS} or both")
        if any(r < 1 for r in self.sim_ranks) or self.process_ranks < 1 or self.runs < 1:
            raise ValueError("--sim-ranks, --process-ranks and --runs must be >= 1")

    def _check_durations_and_loads(self) -> None:
        if self.duration_s <= 0 or self.process_duration_s <= 0 or self.max_wait_s <= 0:
            raise ValueError("--duration, --process-duration and --stagger-max-wait-ms must be positive")
        if not self.loads or any(load not in SIM_LOADS for load in self.loads):
            raise ValueError(f"--loads must be among {tuple(SIM_LOADS)}")


def row(backend: str, ranks: int, load: str, mode: str, cost_scale: float, result: EpResult) -> dict[str, Any]:
    return {
        "backend": backend,
        "ranks": ranks,
        "load": load,
        "mode": mode,
        "cost_scale": cost_scale,
        "ttft_p50_s": round(result.ttft_p50_s, 4),
        "ttft_p99_s": round(result.ttft_p99_s, 4),
        "tpot_p50_s": round(result.tpot_p50_s, 5),
        "prefill_idle_forward_ratio": round(result.prefill_idle_forward_ratio, 4),
        "decode_idle_forward_ratio": round(result.decode_idle_forward_ratio, 4),
        "prefill_idle_compute_s": _seconds(result.prefill_idle_compute_s),
        "decode_idle_compute_s": _seconds(result.decode_idle_compute_s),
        "decode_step_imbalance": None
        if np.isnan(result.decode_step_imbalance)
        else round(result.decode_step_imbalance, 4),
        "output_throughput": round(result.output_throughput, 1),
        "requests": result.requests,
    }


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def simulate(
    ranks: int,
    load: str,
    trace: list[TraceRequest],
    seed: int,
    cost_scale: float = 1.0,
    max_wait_s: float = MAX_WAIT_S,
) -> list[dict[str, Any]]:
    costs = scaled_costs(cost_scale, SimConfig())
    return [
        row(
            "simulation",
            ranks,
            load,
            mode,
            cost_scale,
            EpSimulation(ranks, mode == "staggered", costs, max_wait_s * cost_scale, ALIGN_MS * cost_scale, seed).run(
                trace
            ),
        )
        for mode in MODES
    ]


@dataclass
class ProcessRuns:
    """One mode and load on the processes, pooled over the runs."""

    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    prefill: np.ndarray = field(default_factory=lambda: np.zeros(len(RANK_COUNTERS)))
    decode: np.ndarray = field(default_factory=lambda: np.zeros(len(RANK_COUNTERS)))
    """The ranks' counters moved by each run's last arrival, by role."""
    tokens: int = 0
    elapsed_s: float = 0.0
    failed: int = 0
    """Requests that got no complete answer (left out of the TTFT and TPOT percentiles)."""
    failures: Counter[str] = field(default_factory=Counter)
    """Why they failed (``stagger.failure``: the error, the transport error under it, when),
    with the seconds rounded so that one cause counts once."""
    client_lag_s: float = 0.0
    """The client's worst event-loop lag in any run (``Replayed.client_lag_s``)."""
    run_p50s: list[float] = field(default_factory=list)

    def result(self, requests: int, runs: int = 1, idle_forward_s: float | None = None) -> EpResult:
        """The pooled numbers; idle-forward compute per run, each idle forward costing
        ``idle_forward_s`` (what the sim engine sleeps in one; None for an engine whose idle
        forwards cost what they compute: not known here). A decode step's per-rank times are not in
        the ranks' counters (they are cumulative), so its imbalance is NaN here."""
        return EpResult(
            ttft_p50_s=float(np.percentile(self.ttfts, 50)),
            ttft_p99_s=float(np.percentile(self.ttfts, 99)),
            tpot_p50_s=float(np.percentile(self.tpots, 50)) if self.tpots else 0.0,
            prefill_idle_forward_ratio=self.prefill[1] / max(self.prefill[0], 1),
            decode_idle_forward_ratio=self.decode[1] / max(self.decode[0], 1),
            prefill_idle_compute_s=None if idle_forward_s is None else self.prefill[1] * idle_forward_s / runs,
            decode_idle_compute_s=None if idle_forward_s is None else self.decode[1] * idle_forward_s / runs,
            decode_step_imbalance=float("nan"),
            output_throughput=self.tokens / max(self.elapsed_s, 1e-9),
            requests=requests,
            prefill_batches=0,
        )


def _topology(ranks: int) -> tuple[str, ...]:
    return ("--prefill", "1", "--prefill-dp", str(ranks), "--decode", "1", "--decode-dp", str(ranks))


def _measure(system: _System, trace: list[TraceRequest], runs: ProcessRuns, progress: Callable[[str], None]) -> None:
    time.sleep(1.0)  # let the last load's drain settle into the counters
    before = system.counters(Role.PREFILL), system.counters(Role.DECODE)
    done = asyncio.run(
        _replay(
            f"http://127.0.0.1:{system.port}/v1",
            trace,
            lambda: (system.counters(Role.PREFILL), system.counters(Role.DECODE)),
        )
    )
    runs.client_lag_s = max(runs.client_lag_s, done.client_lag_s)
    if done.client_lag_s > 1.0:
        progress(f"  the client's event loop lagged up to {done.client_lag_s:.1f}s: it is starved of CPU")
    if done.failed:
        progress(f"  {len(done.failed)} of {len(trace)} requests failed; the first: {done.failed[0]}")
        runs.failed += len(done.failed)
        runs.failures.update(re.sub(r"\d+\.\d+s after", "…s after", f) for f in done.failed)
        for line in [o for o in system.output if "ERROR" in o or "WARNING" in o][-10:]:
            progress(f"  system: {line.rstrip()}")
    runs.ttfts += done.ttfts
    runs.tpots += done.tpots
    runs.run_p50s.append(float(np.percentile(done.ttfts, 50)))
    runs.prefill += done.at_last_arrival[0] - before[0]
    runs.decode += done.at_last_arrival[1] - before[1]
    runs.tokens, runs.elapsed_s = runs.tokens + done.tokens, runs.elapsed_s + done.elapsed_s


def run_processes(config: EpBenchConfig, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Naive and staggered on real rank processes, each trace ``config.runs`` times per mode (the
    modes take turns going first), then the simulation of the same traces and costs."""
    ranks = config.process_ranks
    traces = {
        load: _trace(PROCESS_LOADS[load] * ranks, config.process_duration_s, config.seed, f"{load}-load process")
        for load in config.loads
    }
    pooled = {(mode, load): ProcessRuns() for mode in MODES for load in traces}
    for run in range(config.runs):
        for mode in MODES[::-1] if run % 2 else MODES:
            _run_mode(config, run, mode, traces, pooled, progress)
    rows = [_process_row(config, ranks, mode, load, runs, len(traces[load])) for (mode, load), runs in pooled.items()]
    for load, trace in traces.items():
        rows += simulate(ranks, load, trace, config.seed, PROCESS_COST_SCALE, config.max_wait_s)
    return rows


def _run_mode(
    config: EpBenchConfig,
    run: int,
    mode: str,
    traces: dict[str, list[TraceRequest]],
    pooled: dict[tuple[str, str], ProcessRuns],
    progress: Callable[[str], None],
) -> None:
    """One run of every load's trace in one mode, on one system of rank processes started for it."""
    ranks = config.process_ranks
    system = _System(ranks, mode == "staggered", PROCESS_COST_SCALE, SimConfig(), _topology(ranks), config.max_wait_s)
    try:
        for load, trace in traces.items():
            progress(f"processes: {ranks}+{ranks} ranks, {mode}, {load} load, run {run + 1} of {config.runs}")
            _measure(system, trace, pooled[(mode, load)], progress)
    finally:
        system.stop()


def _process_row(
    config: EpBenchConfig, ranks: int, mode: str, load: str, runs: ProcessRuns, requests: int
) -> dict[str, Any]:
    return {
        **row("processes", ranks, load, mode, PROCESS_COST_SCALE, runs.result(requests, config.runs, IDLE_FORWARD_S)),
        "runs": config.runs,
        "failed": runs.failed,
        "failures": dict(runs.failures.most_common(5)),
        "client_lag_max_s": round(runs.client_lag_s, 3),
        "runs_ttft_p50_s": [round(p, 4) for p in runs.run_p50s],
    }


def run_ep_bench(config: EpBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    results = []
    if "processes" in config.backends:
        results += run_processes(config, progress)
    if "simulation" in config.backends:
        for ranks in config.sim_ranks:
            for load in config.loads:
                progress(f"simulation: {ranks}+{ranks} ranks, {load} load")
                trace = _trace(SIM_LOADS[load] * ranks, config.duration_s, config.seed, f"{load}-load simulated")
                results += simulate(ranks, load, trace, config.seed, max_wait_s=config.max_wait_s)
    return {
        "seed": config.seed,
        "duration_s": config.duration_s,
        "process_duration_s": config.process_duration_s,
        "runs": config.runs,
        "stagger_max_wait_s": config.max_wait_s,
        "sim_loads_per_prefill_rank": SIM_LOADS,
        "process_loads_per_prefill_rank": PROCESS_LOADS,
        "process_cost_scale": PROCESS_COST_SCALE,
        "costs": asdict(SimConfig()),
        "results": results,
    }
