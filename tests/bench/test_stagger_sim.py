"""The discrete-event simulation behind ``splitbus bench stagger``, on hand-made traces."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from splitbus.bench import report, stagger_sim
from splitbus.bench.stagger import (
    ALIGN_MS,
    MAX_WAIT_S,
    MODES,
    SIM_LOADS,
    ProcessRuns,
    StaggerBenchConfig,
    distinct_prompt,
    run_stagger_bench,
    scaled_costs,
)
from splitbus.bench.stagger_sim import NO_EP, GroupFull, GroupSimulation, TraceRequest, poisson_trace
from splitbus.worker.engines.sim import SimConfig


@pytest.mark.parametrize("staggered", [False, True])
def test_one_request_leaves_the_other_ranks_idle(staggered: bool) -> None:
    result = GroupSimulation(4, staggered=staggered).run([TraceRequest(0.0, 100, 10)])
    # The step that starts at the (only) arrival has one working rank and three idle forwards;
    # the drain after the last arrival is not counted.
    assert result.idle_forward_ratio == pytest.approx(0.75)
    assert result.idle_time_ratio == pytest.approx(0.75)
    assert 0 < result.step_utilization <= 0.25


def test_counters_cover_the_steps_that_start_by_the_last_arrival() -> None:
    trace = [TraceRequest(0.0, 100, 10), TraceRequest(0.00501, 100, 10)]  # the second comes in the first decode step
    result = GroupSimulation(2, staggered=True).run(trace)  # water-filling: the second goes to rank 1
    # Counted: the prefill step (rank 1 idle) and the decode step the second arrival came in
    # (rank 1 idle again): 2 of 4 rank-steps. Not counted: 10 more steps (rank 1's prefill and
    # 9 decodes), the last 2 with rank 0 idle: 4 idle of 24 rank-steps in all.
    assert result.idle_forward_ratio == pytest.approx(0.5)
    assert result.idle_forward_ratio_all_steps == pytest.approx(4 / 24)


def test_time_shares_add_up_to_at_most_one() -> None:
    trace = poisson_trace(80.0, 2.0, seed=3)
    for staggered in (False, True):
        result = GroupSimulation(8, staggered=staggered, seed=3).run(trace)
        assert result.requests == len(trace)
        assert result.idle_time_ratio + result.step_utilization <= 1.0 + 1e-9


def test_a_window_whose_bound_comes_in_the_middle_of_a_step_goes_out_there() -> None:
    """As the scheduler's window does: b's window closes at its bound, inside a's prefill step,
    and c, arriving after that, waits in a window of its own. The model used to close every window
    at the step's end, crediting a short bound with one batch per step."""
    # a's 1000-token prefill runs 50 ms (50 us a token); b and c arrive 10 and 40 ms into it.
    trace = [TraceRequest(0.0, 1000, 1), TraceRequest(0.010, 100, 1), TraceRequest(0.040, 100, 1)]
    short = GroupSimulation(2, staggered=True, max_wait_s=0.02)
    long = GroupSimulation(2, staggered=True, max_wait_s=0.5)
    short.run(trace)
    long.run(trace)
    # 20 ms: a alone (the group was idle), b at 30 ms, c at the step's end. 500 ms: b and c together.
    assert (short.batches, long.batches) == (3, 2)


def test_replayed_prompts_share_no_prefix_and_repeat_for_the_same_request() -> None:
    trace = poisson_trace(200.0, 1.0, seed=1)
    prompts = [distinct_prompt(req, i) for i, req in enumerate(trace)]
    assert [len(p) for p in prompts] == [req.prompt_tokens for req in trace]
    assert all(97 <= t <= 122 for p in prompts for t in p)
    assert len({tuple(p[:16]) for p in prompts}) == len(trace)  # no two share their first KV block
    assert distinct_prompt(trace[3], 3) == prompts[3]


def test_a_request_that_fits_nowhere_is_an_error_not_a_drop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stagger_sim, "KV_BLOCKS_PER_RANK", 4)
    with pytest.raises(GroupFull, match="no rank has KV room"):
        GroupSimulation(2, staggered=False).run([TraceRequest(0.0, 1000, 10)])


def test_the_report_has_the_promised_fields_a_table_and_a_plot(tmp_path: Path) -> None:
    result = run_stagger_bench(
        StaggerBenchConfig((4,), process_ranks=0, duration_s=1.0, seed=1), progress=lambda _: None
    )
    assert {(r["load"], r["mode"]) for r in result["results"]} == {(load, mode) for load in SIM_LOADS for mode in MODES}
    for row in result["results"]:
        assert row["backend"] == "simulation" and row["ranks"] == 4 and row["cost_scale"] == 1.0
        assert (
            0 <= row["idle_forward_ratio"] <= 1
            and 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
            and row["throughput_tok_s"] > 0
        )
    report.stagger_plot(result, tmp_path / "stagger.png")
    assert (tmp_path / "stagger.png").stat().st_size > 10_000


@pytest.mark.parametrize("staggered", [False, True])
def test_time_scaled_costs_scale_every_time_in_the_simulation(staggered: bool) -> None:
    trace = poisson_trace(40.0, 2.0, seed=5)
    slow_trace = [TraceRequest(t.arrival_s * 4, t.prompt_tokens, t.output_tokens) for t in trace]
    fast = GroupSimulation(4, staggered=staggered, seed=5).run(trace)
    slow = GroupSimulation(
        4, staggered=staggered, seed=5, costs=scaled_costs(4.0), max_wait_s=4 * MAX_WAIT_S, align_ms=4 * ALIGN_MS
    ).run(slow_trace)
    # Costs, gaps and the window's bounds all 4x: the same run, 4x slower (what the process backend
    # relies on), up to the simulation's fixed 1 us tick while only the window holds work.
    assert slow.ttft_p50_s == pytest.approx(4 * fast.ttft_p50_s, rel=1e-4) and slow.idle_forward_ratio == pytest.approx(
        fast.idle_forward_ratio
    )


def test_process_runs_pool_every_repeat(tmp_path: Path) -> None:
    runs = ProcessRuns()
    runs.add([0.1, 0.2, 0.3], np.array([10, 1, 1000, 100, 500]), np.array([20, 11, 0, 0, 0]), tokens=30, elapsed_s=1.0)
    runs.add([0.4, 0.5, 0.6], np.array([10, 3, 1000, 300, 500]), np.array([20, 9, 0, 0, 0]), tokens=50, elapsed_s=1.0)
    row = runs.row(4, "moderate", "staggered", requests=3)
    assert row["runs_ttft_p50_s"] == [0.2, 0.5]
    assert row["ttft_p50_s"] == pytest.approx(0.35)  # the pooled six, not the mean of the two medians
    assert row["idle_forward_ratio"] == pytest.approx(4 / 20) and row["idle_time_ratio"] == pytest.approx(400 / 2000)
    assert row["idle_forward_ratio_all_steps"] == pytest.approx(20 / 40)  # the drains' steps too
    assert row["throughput_tok_s"] == pytest.approx(40.0)
    result = {"seed": 1, "results": [row, {**row, "mode": "naive"}]}
    assert "TTFT p50 of each run, ms: 200.0, 500.0" in report.stagger_table(result)
    report.stagger_plot(result, tmp_path / "stagger.png")
    assert (tmp_path / "stagger.png").stat().st_size > 10_000


def test_with_the_ep_cost_model_a_step_adds_the_all_to_all_of_the_largest_rank() -> None:
    costs = SimConfig()  # the sim engine's defaults: EP's all-to-all included
    result = GroupSimulation(2, staggered=False, costs=costs).run([TraceRequest(0.0, 100, 1)])
    # One step: rank 0 prefills 100 tokens (the request's only token), rank 1 idles; both wait
    # for the all-to-all, sized by rank 0's 100 tokens.
    assert result.ttft_p50_s == pytest.approx(costs.group_step_s([("prefill", 100), ("idle", 0)]))
    assert result.ttft_p50_s == pytest.approx(costs.forward_s("prefill", 100) + costs.all_to_all_s([100]))
    no_ep = GroupSimulation(2, staggered=False).run([TraceRequest(0.0, 100, 1)])  # bench stagger's model
    assert no_ep.ttft_p50_s == pytest.approx(costs.forward_s("prefill", 100))


def test_scaled_costs_scale_every_cost_and_leave_the_all_to_all_out_by_default() -> None:
    assert scaled_costs(4.0) == replace(NO_EP, prefill_s_per_token=2e-4, decode_step_s=0.016, decode_s_per_seq=4e-4)
    ep = scaled_costs(2.0, SimConfig())
    assert (ep.a2a_s, ep.a2a_s_per_token) == pytest.approx((2 * SimConfig().a2a_s, 2 * SimConfig().a2a_s_per_token))


def test_a_failed_requests_reason_names_the_transport_error_under_openais() -> None:
    """openai says only "Connection error."; the cause under it (a reset: ReadError) and where the
    request was are what tell a closed-before-read connection from a stream cut mid-way."""
    import httpx
    import openai

    from splitbus.bench.stagger import failure

    try:
        try:
            raise httpx.ReadError("")
        except httpx.ReadError as cause:
            raise openai.APIConnectionError(request=httpx.Request("POST", "http://x")) from cause
    except openai.APIConnectionError as exc:
        said = failure(exc, [0.0, 0])
    assert said == "APIConnectionError: Connection error. (ReadError: ), before sending, 0 tokens in"
