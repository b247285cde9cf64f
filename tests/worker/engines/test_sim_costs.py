"""The sim engine's cost model (pure): a rank's compute, and a DP group's step with EP's all-to-all."""

from __future__ import annotations

import argparse

import pytest

from splitbus.worker.engines.sim import SimConfig, SimType

COSTS = SimConfig(
    prefill_s_per_token=1e-4, decode_step_s=0.006, decode_s_per_seq=1e-4, a2a_s=0.002, a2a_s_per_token=1e-5
)


def test_a_ranks_compute_is_what_a_lone_sim_worker_sleeps() -> None:
    assert COSTS.forward_s("prefill", 300) == pytest.approx(0.03)
    assert COSTS.forward_s("decode", 10) == pytest.approx(0.007)
    assert COSTS.forward_s("idle", 0) == COSTS.decode_step_s  # an idle forward joins the collective
    assert COSTS.forward_s("none", 0) == 0.0


def test_the_all_to_all_grows_with_the_rank_that_puts_the_most_tokens_through() -> None:
    assert COSTS.all_to_all_s([]) == COSTS.a2a_s
    assert COSTS.all_to_all_s([40, 0, 1]) == pytest.approx(0.002 + 40e-5)
    assert COSTS.all_to_all_s([40, 4000]) == pytest.approx(0.002 + 4000e-5)


def test_a_group_step_is_the_slowest_ranks_compute_plus_the_all_to_all() -> None:
    # The slowest compute is rank 0's decode; the largest token count is rank 1's prefill.
    step = COSTS.group_step_s([("decode", 1), ("prefill", 40), ("idle", 0)])
    assert step == pytest.approx(COSTS.forward_s("decode", 1) + COSTS.a2a_s + 40 * COSTS.a2a_s_per_token)
    assert COSTS.group_step_s([("none", 0), ("none", 0)]) == 0.0  # the group does not step


def test_without_the_all_to_all_a_group_step_lasts_as_long_as_its_slowest_rank() -> None:
    no_ep = SimConfig(a2a_s=0.0, a2a_s_per_token=0.0)
    assert no_ep.group_step_s([("prefill", 4096), ("idle", 0)]) == no_ep.forward_s("prefill", 4096)


def test_by_default_a_long_prefill_step_lasts_about_ten_decode_steps() -> None:
    # docs/dp.md, "EP cost model": DeepSeek-V3's published service figures make a 4k-token
    # prefill step about 9 decode steps; the default costs give about 11 (32 sequences a rank).
    default = SimConfig()
    prefill = default.group_step_s([("prefill", 4096), ("idle", 0)])
    decode = default.group_step_s([("decode", 32), ("decode", 32)])
    assert 8 <= prefill / decode <= 14
    assert default.a2a_s > default.forward_s("decode", 32)  # the all-to-all dominates a decode step


def test_the_cli_options_set_the_all_to_all_and_default_to_the_configs() -> None:
    parser = argparse.ArgumentParser()
    SimType().add_arguments(parser)
    assert SimType().options_from(parser.parse_args([])) == SimConfig()
    options = SimType().options_from(parser.parse_args(["--sim-ep-a2a-ms", "3", "--sim-ep-a2a-us-per-token", "20"]))
    assert (options.a2a_s, options.a2a_s_per_token) == pytest.approx((0.003, 2e-5))


def test_negative_all_to_all_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="sim costs must be >= 0"):
        SimConfig(a2a_s_per_token=-1.0)
