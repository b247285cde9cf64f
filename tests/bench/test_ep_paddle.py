"""``bench ep --engine paddle``'s pure parts: the sim costs fitted to calibration medians, the
capacity the loads are shares of, its config's checks and its table. (The benchmark itself runs
real processes: docs/benchmarks.md has its command and numbers.)"""

from __future__ import annotations

import pytest

from splitbus.bench import ep_paddle
from splitbus.worker.engines.sim import SimConfig


def points(costs: SimConfig) -> list[dict[str, object]]:
    """Two ranks' medians as a machine with exactly ``costs`` would measure them."""
    rows: list[dict[str, object]] = []
    for rank in range(2):
        for batch in ep_paddle.DECODE_BATCHES:
            exchange = costs.a2a_s + costs.a2a_s_per_token * batch
            forward = costs.decode_step_s + costs.decode_s_per_seq * batch + exchange
            rows.append({"rank": rank, "kind": "decode", "tokens": batch, "forward_s": forward, "exchange_s": exchange})
        for prompt in ep_paddle.PREFILL_TOKENS:
            exchange = costs.a2a_s + costs.a2a_s_per_token * prompt
            forward = costs.prefill_s_per_token * prompt + exchange
            rows.append(
                {"rank": rank, "kind": "prefill", "tokens": prompt, "forward_s": forward, "exchange_s": exchange}
            )
            waited = exchange + (costs.prefill_s_per_token * prompt if rank else 0.0)  # the others wait for rank 0
            rows.append({"rank": rank, "kind": "skewed", "tokens": prompt, "forward_s": forward, "exchange_s": waited})
    return rows


def test_the_fit_recovers_the_costs_the_points_were_made_of() -> None:
    made = SimConfig(
        prefill_s_per_token=3e-4, decode_step_s=6e-3, decode_s_per_seq=4e-4, a2a_s=0.08, a2a_s_per_token=1e-4
    )
    fitted = ep_paddle.fit(points(made))
    for name in ep_paddle.COSTS:
        assert getattr(fitted, name) == pytest.approx(getattr(made, name), rel=1e-6), name
    residuals = ep_paddle.exchange_residuals(points(made), fitted)  # the busiest rank's: on the line
    assert set(residuals) == {"decode", "prefill", "skewed"}
    assert all(abs(r) < 1e-9 for kind in residuals.values() for r in kind)


def test_the_capacity_is_what_the_ranks_prefill_of_the_mean_prompt_at_their_share() -> None:
    costs = SimConfig(prefill_s_per_token=1e-3, a2a_s=0.0, a2a_s_per_token=0.0)
    assert ep_paddle.capacity(costs, ranks=4, cpu_share=0.5) == pytest.approx(4 * 0.5 / 0.544)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"ranks": 1}, "--process-ranks must be >= 2"), ({"loads": ("peak",)}, "--loads must be among")],
)
def test_a_bad_config_is_refused_with_its_reason(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ep_paddle.PaddleEpConfig(**kwargs)  # type: ignore[arg-type]


def test_the_table_averages_the_models_seeds_beside_the_processes_rows() -> None:
    base = {"ranks": 4, "cost_scale": 1.0, "ttft_p99_s": 0.2, "tpot_p50_s": 0.01, "output_throughput": 10.0}
    base |= {"prefill_idle_forward_ratio": 0.5, "decode_idle_forward_ratio": 0.1, "load": "moderate"}
    results = [
        {**base, "backend": "paddle processes", "mode": "naive", "ttft_p50_s": 1.0, "idle_forward_s": 3.0},
        {**base, "backend": "calibrated simulation", "mode": "naive", "ttft_p50_s": 0.2, "seed": 1},
        {**base, "backend": "calibrated simulation", "mode": "naive", "ttft_p50_s": 0.4, "seed": 2},
    ]
    costs = dict.fromkeys(ep_paddle.COSTS, 0.001)
    lines = ep_paddle.table({"results": results, "calibration": {"costs": costs}}).splitlines()
    assert "1000.0" in lines[1] and "3.00" in lines[1]
    assert lines[2].startswith("calibrated simulation") and "300.0" in lines[2]  # (0.2 + 0.4) / 2 s
