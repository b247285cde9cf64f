"""The discrete-event simulation behind ``splitbus bench stagger``, on hand-made traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitbus.bench import report, stagger_sim
from splitbus.bench.stagger import MODES, SIM_LOADS, WINDOW_SWEEP, StaggerBenchConfig, run_stagger_bench, scaled_costs
from splitbus.bench.stagger_sim import GroupFull, GroupSimulation, TraceRequest, poisson_trace


@pytest.mark.parametrize("staggered", [False, True])
def test_one_request_leaves_the_other_ranks_idle(staggered: bool) -> None:
    result = GroupSimulation(4, staggered=staggered).run([TraceRequest(0.0, 100, 10)])
    # Every step (1 prefill + 9 decodes) has one working rank and three idle forwards.
    assert result.idle_forward_ratio == pytest.approx(0.75)
    assert result.idle_time_ratio == pytest.approx(0.75)
    assert 0 < result.step_utilization <= 0.25


def test_time_shares_add_up_to_at_most_one() -> None:
    trace = poisson_trace(80.0, 2.0, seed=3)
    for staggered in (False, True):
        result = GroupSimulation(8, staggered=staggered, seed=3).run(trace)
        assert result.requests == len(trace)
        assert result.idle_time_ratio + result.step_utilization <= 1.0 + 1e-9


def test_a_request_that_fits_nowhere_is_an_error_not_a_drop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stagger_sim, "KV_BLOCKS_PER_RANK", 4)
    with pytest.raises(GroupFull, match="no rank has KV room"):
        GroupSimulation(2, staggered=False).run([TraceRequest(0.0, 1000, 10)])


def test_the_report_has_the_promised_fields_a_table_and_a_plot(tmp_path: Path) -> None:
    result = run_stagger_bench(StaggerBenchConfig((4,), process_ranks=0, duration_s=1.0, seed=1), progress=lambda _: None)
    assert {(r["load"], r["mode"]) for r in result["results"]} == {(load, mode) for load in SIM_LOADS for mode in MODES}
    for row in result["results"]:
        assert row["backend"] == "simulation" and row["ranks"] == 4 and row["cost_scale"] == 1.0
        assert 0 <= row["idle_forward_ratio"] <= 1 and 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and row["throughput_tok_s"] > 0
    assert [w["steps_held"] for w in result["window_sweep"]] == list(WINDOW_SWEEP)
    assert "window sweep" in report.stagger_table(result)
    report.stagger_plot(result, tmp_path / "stagger.png")
    assert (tmp_path / "stagger.png").stat().st_size > 10_000


def test_time_scaled_costs_scale_every_time_in_the_simulation() -> None:
    trace = poisson_trace(40.0, 2.0, seed=5)
    slow_trace = [TraceRequest(t.arrival_s * 4, t.prompt_tokens, t.output_tokens) for t in trace]
    fast = GroupSimulation(4, staggered=False, seed=5).run(trace)
    slow = GroupSimulation(4, staggered=False, seed=5, costs=scaled_costs(4.0)).run(slow_trace)
    # Naive placement has no time constants of its own: 4x costs at 1/4 the rate is the same run, 4x slower.
    assert slow.ttft_p50_s == pytest.approx(4 * fast.ttft_p50_s) and slow.idle_forward_ratio == pytest.approx(fast.idle_forward_ratio)
