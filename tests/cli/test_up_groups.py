"""What `splitbus up --prefill-dp K --decode-dp L` starts (splitbus/cli/up.py): prefill and
decode groups of ranks, each rank restarted like `--dp`'s when its group breaks. No processes:
the parts are recorded, not started."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from splitbus.cli import up
from splitbus.cli.main import build_parser
from splitbus.env import load_env


class Recorded:
    """A supervisor that records what it is asked to start."""

    def __init__(self) -> None:
        self.parts: dict[str, tuple[list[str], dict[int, str]]] = {}

    def start(
        self,
        name: str,
        args: list[str],
        env: object = None,
        exits: dict[int, str] | None = None,
        stop_signal: object = None,
    ) -> None:
        self.parts[name] = (args, dict(exits or {}))


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(load_env({})).parse_args(["up", "--engine", "sim", *argv])


def started(*argv: str) -> dict[str, tuple[list[str], dict[int, str]]]:
    args, supervisor, model = parse(*argv), Recorded(), up.ServedModel(Path("model"), "model")
    up._start_parts(supervisor, args, "redis://x", model, up.worker_counts(args))  # type: ignore[arg-type]  # a recorder
    return supervisor.parts


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_groups_of_each_role_are_started_rank_by_rank() -> None:
    parts = started("--prefill", "2", "--prefill-dp", "2", "--decode", "1", "--decode-dp", "3")
    ranks = sorted(name for name in parts if "-r" in name)
    assert ranks == ["d0-r0", "d0-r1", "d0-r2", "p0-r0", "p0-r1", "p1-r0", "p1-r1"]
    for name in ranks:
        args, exits = parts[name]
        group, rank = name.split("-r")
        assert _flag(args, "--role") == ("prefill" if group.startswith("p") else "decode")
        assert (_flag(args, "--dp-group"), _flag(args, "--dp-rank")) == (group, rank)
        assert _flag(args, "--dp-size") == ("2" if group.startswith("p") else "3")
        assert exits[up.EXIT_DP_GROUP_BROKEN].startswith(f"DP group {group} is broken")  # said, then restarted
    assert _flag(parts["scheduler"][0], "--mode") == "splitwise_dp"  # rank-level placement once groups exist


def test_a_group_size_of_one_is_todays_single_workers_and_the_roles_mix() -> None:
    parts = started("--prefill", "2", "--decode", "1", "--decode-dp", "2", "--mixed", "1")
    assert sorted(parts) == ["api", "d0-r0", "d0-r1", "mixed0", "prefill0", "prefill1", "scheduler"]
    assert "--dp-group" not in parts["prefill0"][0] and parts["prefill0"][1] == {}
    assert _flag(started("--prefill", "2", "--decode", "1")["scheduler"][0], "--mode") == "splitwise"  # no group


def test_dp_mixed_groups_are_started_as_before() -> None:
    parts = started("--dp", "2")
    args, exits = parts["rank1"]
    assert args[args.index("--role") :] == ["--role", "mixed", "--dp-group", "g0", "--dp-rank", "1", "--dp-size", "2"]
    assert exits[up.EXIT_DP_GROUP_BROKEN].startswith("DP group g0 is broken")
    assert _flag(parts["scheduler"][0], "--mode") == "dp"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--prefill-dp", "0"), "count the ranks of each group: at least 1"),
        (("--dp", "2", "--decode-dp", "2"), "does not combine"),
    ],
)
def test_group_sizes_that_make_no_sense_are_refused(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        up.worker_counts(parse(*argv))


def test_ep_goes_to_every_rank_of_a_group_and_to_no_single_worker() -> None:
    parts = started("--prefill", "1", "--decode", "1", "--decode-dp", "2", "--ep")
    assert "--ep" in parts["d0-r0"][0] and "--ep" in parts["d0-r1"][0]
    assert "--ep" not in parts["prefill0"][0]  # a worker on its own holds every expert
    assert "--ep" in started("--dp", "2", "--ep")["rank0"][0]
    with pytest.raises(ValueError, match="--ep splits experts over a DP group's ranks"):
        started("--prefill", "1", "--decode", "1", "--ep")
