"""A worker's configuration (splitbus/worker/config.py): which DP ranks it accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.worker.config import WorkerConfig


def config(role: str, group: str = "g0", rank: int = 0, size: int = 2) -> WorkerConfig:
    return WorkerConfig(
        bus=BusConfig(), role=role, model_dir=Path("m"), model_name="m", dp_group=group, dp_rank=rank, dp_size=size
    )


@pytest.mark.parametrize("role", ["mixed", "prefill", "decode"])
def test_a_dp_rank_of_each_role_is_accepted(role: str) -> None:
    made = config(role, "p0", 1, 2)
    assert (made.role, made.dp_group, made.dp_rank, made.dp_size) == (role, "p0", 1, 2)
    assert made.worker_id.startswith(f"{role}-")


@pytest.mark.parametrize(("group", "rank", "size"), [("", 0, 2), ("g0", 2, 2), ("g0", -1, 2)])
def test_a_dp_rank_needs_a_group_and_a_rank_within_its_size(group: str, rank: int, size: int) -> None:
    with pytest.raises(ValueError, match=r"^a DP rank needs --dp-group and 0 <= --dp-rank < --dp-size$"):
        config("decode", group, rank, size)


def test_a_group_or_rank_without_a_size_is_refused() -> None:
    with pytest.raises(ValueError, match="need --dp-size"):
        config("prefill", "p0", 0, 0)


def test_a_worker_on_its_own_has_no_dp_fields() -> None:
    assert config("prefill", "", -1, 0).dp_size == 0


def test_ep_needs_a_group_of_two_and_an_engine_that_splits_experts() -> None:
    def ep(engine: str, size: int) -> WorkerConfig:
        group = ("g0", 0, size) if size else ("", -1, 0)
        return WorkerConfig(
            bus=BusConfig(), role="decode", model_dir=Path("m"), model_name="m", engine=engine,
            dp_group=group[0], dp_rank=group[1], dp_size=group[2], ep=True,
        )  # fmt: skip

    assert ep("paddle", 2).ep
    with pytest.raises(ValueError, match="--dp-size 0 and the paddle engine"):
        ep("paddle", 0)
    with pytest.raises(ValueError, match=r"--dp-size 1 .*paddle"):
        ep("paddle", 1)
    with pytest.raises(ValueError, match=r"the sim engine \(which simulates EP's cost: --sim-ep-a2a-ms\)"):
        ep("sim", 2)


def test_a_drain_is_bounded_and_a_solo_workers_own() -> None:
    def drain(timeout_s: float, size: int = 0) -> WorkerConfig:
        group = ("g0", 0, size) if size else ("", -1, 0)
        return WorkerConfig(
            bus=BusConfig(), role="decode", model_dir=Path("m"), model_name="m",
            dp_group=group[0], dp_rank=group[1], dp_size=group[2], drain_timeout_s=timeout_s,
        )  # fmt: skip

    assert drain(30).drain_timeout_s == 30 and drain(0, 2).drain_timeout_s == 0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"--drain-timeout must be in \[0, 86400.0\] seconds"):
            drain(bad)
    with pytest.raises(ValueError, match="not a DP rank"):
        drain(30, 2)
