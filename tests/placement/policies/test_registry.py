"""The policy registry: the command line's choices are its names, an unknown name is a clear
error, and a new policy is one new file in the package."""

from __future__ import annotations

import argparse
import pkgutil
import sys
import time
from pathlib import Path

import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.streams import Delivery
from splitbus.cli import main as cli
from splitbus.cli import scheduler_cmd
from splitbus.env import load_env
from splitbus.placement import policies
from splitbus.placement.decision import NoPlacement, Placed, Waiting
from splitbus.placement.policies import POLICIES, UnknownPolicy, create, names, register
from splitbus.placement.policies.base import Policy
from splitbus.scheduler.config import SchedulerConfig
from splitbus.scheduler.scheduler import Scheduler
from tests.placement.snapshot import request, worker

BUILT_IN = {"splitwise", "mixed", "dp", "stagger", "splitwise_dp"}

NEW_POLICY = '''
from splitbus.bus.records import Reserved
from splitbus.placement.decision import NoPlacement, Placed, Placement
from splitbus.placement.policies import register
from splitbus.placement.policies.base import Policy


@register("first_alive")
class FirstAlive(Policy):
    """Every request to the first live mixed worker: a policy as small as one can be."""

    def place(self, request, workers, local):
        for w in workers:
            if w.alive and w.record.role == "mixed":
                return Placed((Placement(w, "mixed", "", Reserved(len(request.prompt_token_ids), 1, 1)),))
        return NoPlacement("no live mixed worker")
'''


def _mode_choices() -> list[str]:
    subparsers = argparse.ArgumentParser().add_subparsers()
    scheduler_cmd.add_parser(subparsers, load_env({}))
    (mode,) = [a for a in subparsers.choices["scheduler"]._actions if a.dest == "mode"]
    return list(mode.choices or [])


def test_every_policy_module_registers_one_policy_under_its_own_name() -> None:
    modules = {m.name for m in pkgutil.iter_modules(policies.__path__)} - {"base"}
    assert BUILT_IN <= modules and set(names()) == modules
    for name in modules:
        assert POLICIES[name].name == name and POLICIES[name].__module__ == f"splitbus.placement.policies.{name}"
        assert isinstance(create(name), POLICIES[name])


def test_the_command_lines_modes_are_the_registrys_names() -> None:
    assert _mode_choices() == names()


def test_an_unknown_name_is_a_clear_error(capsys: pytest.CaptureFixture[str], bus_config: BusConfig) -> None:
    with pytest.raises(UnknownPolicy, match=r"no routing policy is named 'nope' \(there are: dp, mixed, splitwise"):
        create("nope")
    with pytest.raises(ValueError, match="mode must be one of"):
        SchedulerConfig(bus_config, mode="nope")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["scheduler", "--mode", "nope"])
    assert exit_.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_two_policies_cannot_share_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policies, "POLICIES", dict(POLICIES))

    class Other(Policy):
        def place(self, *args: object) -> NoPlacement:
            return NoPlacement("a stand-in")

    with pytest.raises(ValueError, match="two routing policies are named 'splitwise'"):
        register("splitwise")(Other)


def test_dp_staggers_unless_told_not_to(bus_config: BusConfig) -> None:
    assert SchedulerConfig(bus_config, mode="dp").policy == "stagger"
    assert SchedulerConfig(bus_config, mode="dp", stagger=False).policy == "dp"
    assert SchedulerConfig(bus_config, mode="splitwise").policy == "splitwise"


def test_stagger_told_not_to_stagger_is_refused(bus_config: BusConfig) -> None:
    with pytest.raises(ValueError, match="--no-stagger"):
        SchedulerConfig(bus_config, mode="stagger", stagger=False)


def test_a_placement_without_tasks_is_refused() -> None:
    # The dispatch would ack the request and write nothing: it would be lost without an error.
    with pytest.raises(ValueError, match="NoPlacement"):
        Placed(())


async def test_a_new_policy_is_one_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bus_config: BusConfig
) -> None:
    """The file alone (here in a second folder of the package's path, as if dropped into
    splitbus/placement/policies/): the registry, the command line and the scheduler find it."""
    (tmp_path / "first_alive.py").write_text(NEW_POLICY)
    monkeypatch.setattr(policies, "__path__", [*policies.__path__, str(tmp_path)])
    monkeypatch.setattr(policies, "POLICIES", dict(POLICIES))
    try:
        assert "first_alive" in names() and "first_alive" in _mode_choices()
        scheduler = Scheduler(SchedulerConfig(bus_config, mode="first_alive"))
        try:
            assert scheduler.policy.name == "first_alive"
            scheduler.view.workers = [worker("p", "prefill"), worker("x", "mixed")]
            decision = await scheduler.decide(Waiting(Delivery("s", "1-0", request()), time.monotonic()))
            assert isinstance(decision, Placed)
            assert [p.worker.record.worker_id for p in decision.placements] == ["x"]
        finally:
            await scheduler.redis.aclose()
    finally:
        sys.modules.pop("splitbus.placement.policies.first_alive", None)
    assert "first_alive" not in POLICIES  # the table the other tests see is untouched
