"""The EP + PD simulation behind ``splitbus bench ep``, on tiny configs (no processes)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from splitbus.bench import report
from splitbus.bench.ep import ROW_FIELDS, EpBenchConfig, ProcessRuns, run_ep_bench
from splitbus.bench.ep_sim import DecodeGroup, EpRequest, EpSimulation
from splitbus.bench.stagger_sim import TraceRequest, poisson_trace
from splitbus.worker.engines.sim import SimConfig

COSTS = SimConfig()


@pytest.mark.parametrize("staggered", [False, True])
def test_a_seeded_run_repeats_exactly(staggered: bool) -> None:
    trace = poisson_trace(60.0, 1.0, seed=5)
    first, second = (EpSimulation(4, staggered, COSTS, 0.05, 20.0, seed=3).run(trace) for _ in range(2))
    assert first == second


@pytest.mark.parametrize("staggered", [False, True])
def test_every_request_prefills_once_and_decodes_all_its_tokens(staggered: bool) -> None:
    trace = poisson_trace(60.0, 1.0, seed=5)
    sim = EpSimulation(4, staggered, COSTS, 0.05, 20.0, seed=3)
    result = sim.run(trace)
    assert result.requests == len(trace)
    # Nothing is left anywhere: every request went through a prefill rank and left its decode rank.
    assert not any(r.queued or r.running for r in sim.prefill.ranks)
    assert not any(r.waiting or r.running for r in sim.decode.ranks)
    assert 0.0 <= result.prefill_idle_forward_ratio <= 1.0
    assert 0.0 <= result.decode_idle_forward_ratio <= 1.0
    assert result.decode_step_imbalance >= 1.0
    assert result.ttft_p50_s <= result.ttft_p99_s
    assert result.tpot_p50_s > 0 and result.output_throughput > 0


def test_one_request_ttft_is_one_prefill_group_step_and_tpot_one_decode_step() -> None:
    result = EpSimulation(2, False, COSTS, 0.05, 20.0).run([TraceRequest(0.0, 400, 5)])
    # Prefill: rank 0 prefills 400 tokens, rank 1 idles; the step = compute + all-to-all of 400.
    assert result.ttft_p50_s == pytest.approx(COSTS.group_step_s([("prefill", 400), ("idle", 0)]))
    # Decode: one sequence on one rank, the other idles (all-to-all of its 1 token).
    assert result.tpot_p50_s == pytest.approx(COSTS.group_step_s([("decode", 1), ("idle", 0)]))
    assert result.prefill_idle_forward_ratio == pytest.approx(0.5)
    # Rank 1's one idle forward costs what the engine sleeps in one; the decode steps start after
    # the (only) arrival, so none of theirs is counted.
    assert result.prefill_idle_compute_s == pytest.approx(COSTS.forward_s("idle", 0))
    assert result.decode_idle_compute_s == 0.0


def test_the_decode_group_keeps_its_step_even() -> None:
    group = DecodeGroup(4, COSTS, seed=1)
    group.ranks[0].running.append(EpRequest(TraceRequest(0.0, 100, 50)))
    placed = [EpRequest(TraceRequest(0.0, 100, 50)) for _ in range(3)]
    for req in placed:
        group.place(req)
    # Rank 0 already runs one: the three go one to each of the others (the group's most
    # sequences stays 1), not to the rank that happens to be first.
    assert sorted(r.decode_rank for r in placed) == [1, 2, 3]
    group.place(extra := EpRequest(TraceRequest(0.0, 100, 50)))
    assert extra.decode_rank in (0, 1, 2, 3)
    assert max(r.load().sequences for r in group.ranks) == 2


def test_process_runs_report_idle_forward_compute_per_run() -> None:
    runs = ProcessRuns(ttfts=[0.1, 0.2], tpots=[0.01])
    runs.prefill += np.array([40, 6, 0, 0, 0])  # two runs' counters, pooled: 6 idle forwards
    runs.decode += np.array([40, 2, 0, 0, 0])
    result = runs.result(requests=2, runs=2, idle_forward_s=0.016)
    assert result.prefill_idle_compute_s == pytest.approx(3 * 0.016)
    assert result.decode_idle_compute_s == pytest.approx(0.016)
    assert result.prefill_idle_forward_ratio == pytest.approx(6 / 40)


def test_the_json_rows_carry_the_promised_fields(tmp_path: Path) -> None:
    config = EpBenchConfig(backends=("simulation",), sim_ranks=(2,), duration_s=0.5, loads=("low", "moderate"))
    result = run_ep_bench(config, progress=lambda _: None)
    assert len(result["results"]) == 4
    for row in result["results"]:
        assert set(ROW_FIELDS) <= set(row)
        assert row["backend"] == "simulation" and row["mode"] in ("naive", "staggered")
    report.ep_plot(result, tmp_path / "ep.png")
    assert (tmp_path / "ep.png").stat().st_size > 0
    assert "TTFT p50" in report.ep_table(result)


@pytest.mark.parametrize(
    "bad",
    [
        {"backends": ("gpu",)},
        {"sim_ranks": (0,)},
        {"runs": 0},
        {"loads": ("extreme",)},
        {"duration_s": 0.0},
        {"max_wait_s": 0.0},
    ],
)
def test_bad_options_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EpBenchConfig(**{**asdict(EpBenchConfig()), **bad})
