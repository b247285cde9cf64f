"""The simulated fleet behind ``splitbus bench planner``, on hand-made and tiny traces."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from splitbus.bench import planner_sim
from splitbus.bench.planner import (
    PlannerBenchConfig,
    arrival_mape,
    comparisons,
    reactions,
    run_planner_bench,
    sized_fleet,
)
from splitbus.bench.planner_sim import H100_8B, FleetSim, Registry, SimCosts, TraceConfig, TraceRequest, trace
from splitbus.bus.planner import Reason
from splitbus.bus.roles import Role
from splitbus.planner.autoscale import START_GRACE_S
from splitbus.planner.predictors import PREDICTORS

TINY = TraceConfig(rate=4.0, phase_s=6.0, long_tokens=1024)


def _request(rid: int, at: float, prompt: int = 512, output: int = 8, prefix: int | None = None) -> TraceRequest:
    key = None if prefix is None else (prefix, prompt)
    return TraceRequest(rid, at, prompt, output, key, 0 if prefix is None else prompt // 2)


def _counters(run: planner_sim.Run, role: Role) -> list[planner_sim.Counters]:
    return [w.counters for w in run.workers if w.role == role]


def test_one_request_takes_its_prefill_transfer_and_decode_steps() -> None:
    costs = H100_8B
    run = FleetSim(costs, (1, 1)).run([_request(0, 1.0, prompt=512, output=8)])
    req = run.requests[0]
    first = 1.0 + costs.prefill_s(512)
    assert req.first_token_at == pytest.approx(first)
    # the KV arrives, then 7 steps of one request each give the other 7 tokens
    assert req.done_at == pytest.approx(first + costs.transfer_s(512) + 7 * costs.decode_s(1))
    assert req.itl_s() == pytest.approx((costs.transfer_s(512) + 7 * costs.decode_s(1)) / 7)
    assert req.ends == 1


def test_workers_keep_the_heartbeat_counters() -> None:
    costs = H100_8B
    run = FleetSim(costs, (1, 1)).run([_request(0, 0.0, output=8, prefix=3), _request(1, 5.0, output=4, prefix=3)])
    (p,) = _counters(run, Role.PREFILL)
    assert (p.prefills_done, p.prompt_tokens_done, p.prompt_tokens_cached) == (
        2,
        1024,
        256,
    )  # the second hit the prefix
    assert p.prefill_busy_us == round(costs.prefill_s(512) * 1e6) + round(costs.prefill_s(256) * 1e6)
    assert (p.running, p.waiting, p.queued_prefill_tokens) == (0, 0, 0)
    (d,) = _counters(run, Role.DECODE)
    assert (d.decodes_done, d.decode_steps, d.decode_tokens_done) == (2, 7 + 3, 7 + 3)
    assert d.decode_time_us == 7 * round(costs.decode_s(1) * 1e6) + 3 * round(costs.decode_s(1) * 1e6)
    assert (d.running, d.waiting, d.free_kv_blocks) == (0, 0, d.total_kv_blocks)  # every block came back


def test_a_prefill_batch_is_bounded_by_its_tokens() -> None:
    costs = replace(H100_8B, max_prefill_tokens=1024)
    run = FleetSim(costs, (1, 1)).run([_request(i, 0.0) for i in range(4)])  # 4 x 512 tokens
    first_tokens = sorted({r.first_token_at or 0.0 for r in run.requests})
    # the first starts alone (the queue held one when it came); then two fit the bound, then the last
    one, two = costs.prefill_s(512), costs.prefill_s(1024)
    assert first_tokens == pytest.approx([one, one + two, one + two + one])


def test_a_request_no_decode_worker_has_room_for_waits_its_turn() -> None:
    costs = replace(H100_8B, kv_blocks=40)  # room for one 512 + 8 token request (33 blocks) at a time
    run = FleetSim(costs, (1, 1)).run([_request(0, 0.0), _request(1, 0.0)])
    first, second = run.requests
    assert first.done_at is not None and second.first_token_at is not None
    assert second.first_token_at > first.done_at  # placed only once the first gave its blocks back
    assert all(r.ends == 1 for r in run.requests)


def test_no_worker_of_a_role_refuses() -> None:
    run = FleetSim(H100_8B, (1, 0)).run([_request(0, 0.0)])
    assert run.requests[0].refused and run.requests[0].ends == 1


def test_the_trace_has_its_phases_and_its_mix() -> None:
    cfg = TraceConfig(rate=50.0, phase_s=40.0)
    reqs = trace(cfg, seed=1)
    counts = [sum(k * cfg.phase_s <= r.arrival_s < (k + 1) * cfg.phase_s for r in reqs) for k in range(3)]
    assert counts[1] / counts[0] == pytest.approx(3, rel=0.15)
    assert counts[1] / counts[2] == pytest.approx(3, rel=0.15)
    first, last = reqs[: len(reqs) // 6], reqs[-len(reqs) // 6 :]
    assert sum(r.prompt_tokens == cfg.long_tokens for r in first) / len(first) < 0.35  # from 20 % long...
    assert sum(r.prompt_tokens == cfg.long_tokens for r in last) / len(last) > 0.65  # ...to 80 %
    assert sum(r.prefix is not None for r in reqs) / len(reqs) == pytest.approx(cfg.shared, abs=0.05)
    assert sum(r.output_tokens for r in reqs) / len(reqs) == pytest.approx(cfg.output_mean, rel=0.15)
    assert trace(cfg, seed=1) == reqs and trace(cfg, seed=2) != reqs


@dataclass(frozen=True)
class _Advice:
    """What ``reconcile`` reads of the planner's advice."""

    desired_prefill: int
    desired_decode: int
    reason_prefill: Reason
    reason_decode: Reason


class _Script:
    """A controller that advises a fixed count after a given time, for ``reason``: scales the
    fleet up, then down."""

    def __init__(self, steps: list[tuple[float, tuple[int, int]]], reason: Reason = Reason.SLO) -> None:
        self.steps, self.reason = steps, reason
        self.seen: list[Registry] = []

    def __call__(self, registry: Registry) -> _Advice | None:
        self.seen.append(registry)
        wanted = [fleet for at, fleet in self.steps if registry.at_s >= at]
        return _Advice(*wanted[-1], self.reason, self.reason) if wanted else None


def test_drains_under_load_lose_and_duplicate_nothing() -> None:
    costs = replace(H100_8B, start_delay_s=2.0)
    script = _Script([(3.0, (3, 3)), (9.0, (1, 1))])
    run = FleetSim(costs, (1, 1), script, interval_s=1.0).run(trace(replace(TINY, rate=8.0), seed=5))
    assert [r.ends for r in run.requests] == [1] * len(run.requests)
    assert not any(r.refused for r in run.requests)
    assert len(run.workers) == 6  # two more of each role started...
    assert sum(w.left_at is not None for w in run.workers) == 4  # ...and drained away
    assert max(s.prefill for s in run.samples) == 3 and run.samples[-1].prefill == 1
    assert any(s.draining != (0, 0) or s.starting != (0, 0) for s in run.samples)
    # the registry shows only workers that are up, and a draining one says so
    draining = [load.draining for reg in script.seen for _, _, load in reg.workers]
    assert 1 in draining and set(draining) == {0, 1}


def test_a_worker_is_paid_from_its_ask_to_its_leave() -> None:
    costs = replace(H100_8B, start_delay_s=2.0)
    script = _Script([(1.0, (2, 1)), (2.0, (1, 1))])
    run = FleetSim(costs, (1, 1), script, interval_s=1.0).run([_request(0, 5.0), _request(1, 15.0)])
    first, extra = [w for w in run.workers if w.role == Role.PREFILL]
    assert (extra.asked_at, extra.left_at) == (1.0, None)  # asked for, then kept to the end...
    assert (first.asked_at, first.left_at) == (0.0, START_GRACE_S)  # ...as the first, past its grace, drained
    paid_prefill = START_GRACE_S + run.end_s - 1.0
    assert run.worker_seconds() == pytest.approx(paid_prefill + run.end_s)
    assert run.worker_seconds(Role.PREFILL) == pytest.approx(paid_prefill)
    assert run.worker_seconds(Role.DECODE) == pytest.approx(run.end_s)


def test_a_fall_the_planner_did_not_measure_drains_nothing() -> None:
    script = _Script([(0.0, (1, 1))], reason=Reason.HELD)  # as a hold advises the count registered
    run = FleetSim(H100_8B, (3, 2), script, interval_s=1.0).run([_request(0, 20.0)])
    assert all(w.left_at is None and not w.draining for w in run.workers)
    assert [(s.prefill, s.decode) for s in run.samples] == [(3, 2)] * len(run.samples)
    assert run.samples[-1].desired == (1, 1) and run.samples[-1].t_s > START_GRACE_S


def test_surplus_workers_drain_one_at_a_time() -> None:
    script = _Script([(0.0, (1, 1))])
    run = FleetSim(H100_8B, (3, 1), script, interval_s=1.0).run([_request(0, 20.0)])
    prefill = [w for w in run.workers if w.role == Role.PREFILL]
    # idle, each leaves as soon as it drains: one a tick, from the first tick past the start grace
    assert sorted(w.left_at for w in prefill if w.left_at is not None) == [START_GRACE_S, START_GRACE_S + 1]
    assert max(s.draining[0] for s in run.samples) <= 1 and run.samples[-1].prefill == 1


def test_the_next_drain_waits_for_a_draining_worker_to_leave() -> None:
    costs = replace(H100_8B, prefill_s_per_token=0.01)  # a 512-token prefill: 5 s
    script = _Script([(0.0, (1, 1))])
    requests = [*(_request(i, 8.0) for i in range(6)), _request(6, 40.0)]
    run = FleetSim(costs, (3, 1), script, interval_s=1.0).run(requests)
    # one drains, holding its requests for seconds, while a surplus one serves on, not drained meanwhile
    assert any(s.draining[0] == 1 and s.prefill == 2 for s in run.samples)
    assert max(s.draining[0] for s in run.samples) == 1 and run.samples[-1].prefill == 1
    first, second = sorted(w.left_at for w in run.workers if w.left_at is not None)
    assert first > START_GRACE_S + 1 and second == math.ceil(first)  # drained at the first tick after it left
    assert [r.ends for r in run.requests] == [1] * 7 and not any(r.refused for r in run.requests)


def test_a_starting_worker_is_never_drained() -> None:
    costs = replace(H100_8B, start_delay_s=20.0)
    script = _Script([(1.0, (2, 1)), (2.0, (1, 1))])
    run = FleetSim(costs, (1, 1), script, interval_s=1.0).run([_request(0, 30.0)])
    first, starting = [w for w in run.workers if w.role == Role.PREFILL]
    assert starting.ready_at == 21.0 and starting.left_at is None and not starting.draining
    assert first.left_at == START_GRACE_S  # the fall drained the one serving, once past its start grace
    assert run.requests[0].ends == 1 and not run.requests[0].refused  # served by the one that started


def test_a_run_is_deterministic_per_seed() -> None:
    reqs = trace(TINY, seed=3)

    def outcome(seed: int) -> list[tuple[float | None, float | None]]:
        run = FleetSim(H100_8B, (2, 1), seed=seed).run(reqs)
        return [(r.first_token_at, r.done_at) for r in run.requests]

    assert outcome(1) == outcome(1)


def test_costs_are_checked() -> None:
    with pytest.raises(ValueError):
        SimCosts(prefill_s_per_token=-1)
    with pytest.raises(ValueError):
        SimCosts(kv_blocks=0)
    with pytest.raises(ValueError):
        TraceConfig(long_to=1.5)
    assert H100_8B.kv_bytes_per_token == 128 * 1024  # 32 layers x 8 KV heads x 128 x K and V x 2 bytes


# ---------------------------------------------------------------- the bench: fleets, comparisons, the CLI

SMALL = PlannerBenchConfig(
    trace=TraceConfig(rate=3.0, phase_s=15.0, long_tokens=1024),
    costs=replace(H100_8B, start_delay_s=2.0),
    seeds=(1, 2),
    interval_s=1.0,
    max_workers=3,
    max_fleet=3,
)


@pytest.fixture(scope="module")
def small_report() -> dict[str, Any]:
    return run_planner_bench(SMALL, lambda line: None)


def test_the_bench_reports_every_fleet_and_accounts_every_request(small_report: dict[str, Any]) -> None:
    requests = sum(len(trace(SMALL.trace, seed)) for seed in SMALL.seeds)
    assert [(f["prefill"], f["decode"]) for f in small_report["fixed"]] == [(1, 1), (1, 2), (2, 1)]
    for fleet in [*small_report["fixed"], small_report["autoscale"]]:
        _accounted(fleet, requests)
    assert set(small_report["comparisons"]) == {"average_sized", "smallest_matching"}
    assert json.loads(json.dumps(small_report)) == small_report  # all JSON
    assert run_planner_bench(SMALL, lambda line: None) == small_report  # deterministic per seed


def test_the_autoscaled_fleet_reports_its_reactions_and_timeline(small_report: dict[str, Any]) -> None:
    auto = small_report["autoscale"]
    assert set(auto["reaction"]) == {"up", "down"}
    assert len(auto["reaction"]["up"]["by_seed"]) == len(SMALL.seeds)
    assert auto["timeline"][0]["t_s"] == SMALL.interval_s
    assert all(s["desired"] is not None for s in auto["timeline"])  # the planner answered every interval
    assert auto["predictor"] == SMALL.predictor and len(auto["attainment_by_phase"]) == 3
    assert list(small_report["predictors"]) == sorted(PREDICTORS)  # each predictor's own autoscaled runs
    assert small_report["predictors"][SMALL.predictor]["attainment"] == auto["attainment"]


def test_the_arrival_error_compares_each_prediction_with_the_next_interval() -> None:
    # the first decision measures nothing; then 10 predicted, 20 came (50 % off); 20 predicted, 10 came (100 %);
    # the last interval ends after the trace: left out
    seen = [(5.0, 0.0, 0.0), (10.0, 10.0, 10.0), (15.0, 20.0, 20.0), (20.0, 10.0, 10.0), (25.0, 0.5, 1.0)]
    assert arrival_mape([seen], until=20.0) == pytest.approx(0.75)
    assert arrival_mape([seen], until=25.0) == pytest.approx((0.5 + 1.0 + 19.0) / 3)
    assert arrival_mape([seen[:2], [(5.0, 0.0, 0.0), (10.0, 0.0, 5.0), (15.0, 0.0, 0.0)]], until=20.0) is None


def _accounted(fleet: dict[str, Any], requests: int) -> None:
    """Every request of every seed counted once, none lost, duplicated or refused."""
    assert fleet["requests"] == requests
    assert (fleet["lost"], fleet["duplicated"], fleet["refused"]) == (0, 0, 0)
    assert 0 <= fleet["attainment"] <= 1 and fleet["worker_seconds"] > 0
    assert sum(fleet["worker_seconds_by_role"].values()) == pytest.approx(fleet["worker_seconds"])


def test_the_fleet_sized_for_a_rate_by_hand() -> None:
    # prompt 1152 (half long), 892.8 uncached (30 % x 3/4 cached): 33.3 req/s x 54.6 ms / 0.8 = 2.3 -> 3;
    # decode: 183 a worker at 18 ms, 33.3 x 128 x 18 ms / 183 = 0.42 -> 1
    config = PlannerBenchConfig()
    assert sized_fleet(config, config.trace.mean_rate()) == (3, 1)
    assert sized_fleet(config, 3 * config.trace.mean_rate()) == (7, 2)


def _fleet(p: int, d: int, attainment: float, seconds: float) -> dict[str, object]:
    return {"prefill": p, "decode": d, "attainment": attainment, "worker_seconds": seconds}


def test_the_targets_are_judged_against_both_readings_of_the_best_fixed_fleet() -> None:
    fixed = [_fleet(2, 1, 0.7, 300.0), _fleet(1, 2, 0.5, 300.0), _fleet(3, 1, 0.95, 400.0), _fleet(4, 1, 0.99, 500.0)]
    auto = {"attainment": 0.96, "worker_seconds": 320.0}
    found = comparisons(fixed, auto, 3)
    a, b = found["average_sized"], found["smallest_matching"]
    assert a["fleet"] == "2:1" and a["attainment_met"] and not a["saving_met"] and not a["met"]
    assert b["fleet"] == "4:1" and b["attainment_met"] is False  # 0.99 > 0.96
    assert b["saving"] == pytest.approx(1 - 320 / 500) and b["saving_met"]
    assert comparisons(fixed, {"attainment": 1.0, "worker_seconds": 1.0}, 9)["smallest_matching"] is None


def _sample(t: float, serving: tuple[int, int], desired: tuple[int, int]) -> planner_sim.Sample:
    return planner_sim.Sample(t, 0.0, serving[0], serving[1], (0, 0), (0, 0), desired)


def test_reaction_times_after_a_step() -> None:
    samples = [
        _sample(5, (2, 1), (2, 1)),
        _sample(10, (2, 1), (2, 1)),  # the step comes at 10
        _sample(15, (2, 1), (2, 1)),
        _sample(20, (2, 1), (4, 1)),  # the planner: 10 s
        _sample(25, (3, 1), (4, 2)),
        _sample(30, (4, 2), (4, 2)),  # the fleet: 20 s
    ]
    run = planner_sim.Run([], [], samples, 30.0)
    config = replace(SMALL, trace=replace(SMALL.trace, phase_s=10.0))
    assert reactions(config, [run])["up"] == {
        "planner_s": 10.0,
        "fleet_s": 20.0,
        "by_seed": [{"planner_s": 10.0, "fleet_s": 20.0}],
    }
    assert reactions(config, [run])["down"]["planner_s"] is None  # it never went down


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "splitbus.cli.main", "bench", "planner", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_the_cli_runs_and_writes_json_and_png(tmp_path: Path) -> None:
    args = ("--rate", "2", "--phase-s", "10", "--seeds", "1", "--max-fleet", "3", "--autoscale", "1:2")
    proc = _cli(*args, "--start-delay-s", "2", "--interval-s", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "bench_planner.json").read_text())
    assert report["config"]["seeds"] == [1] and report["config"]["max_workers"] == 2
    assert report["config"]["costs"]["start_delay_s"] == 2.0 and report["machine"]["cpus"]
    assert (tmp_path / "bench_planner.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "autoscale" in proc.stdout and "(b) smallest" in proc.stdout


@pytest.mark.parametrize(
    "bad", [("--autoscale", "3"), ("--autoscale", "4:2"), ("--autoscale", "1:1001"), ("--seeds", "0"), ("--peak", "0")]
)
def test_the_cli_refuses_bad_options(bad: tuple[str, str], tmp_path: Path) -> None:
    proc = _cli(*bad, "--out", str(tmp_path))
    assert proc.returncode == 2 and "splitbus bench planner:" in proc.stdout + proc.stderr
    assert not (tmp_path / "bench_planner.json").exists()
