"""``up --autoscale``'s rule (splitbus/cli/autoscale.py ``reconcile``), pure: the planner's advice,
the workers running and draining, and the bounds give what to start and what to drain."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from splitbus.bus.core.config import BusConfig
from splitbus.bus.core.connection import connect_sync
from splitbus.bus.planner import Reason
from splitbus.bus.registry import Standing
from splitbus.cli import up
from splitbus.cli.autoscale import Autoscaler, Fleet, advice_reader, held_reader
from splitbus.cli.supervisor import Child, RestartPolicy, Supervisor
from splitbus.env import load_env
from splitbus.planner.autoscale import FALLS, Bounds, Drain, Roster, Start, reconcile
from splitbus.worker.config import default_worker_id
from tests.cli.test_supervisor import wait_all_ready


@dataclass(frozen=True)
class Advice:
    """The fields of the planner's advice ``reconcile`` reads."""

    desired_prefill: int
    desired_decode: int
    reason_prefill: Reason = Reason.SLO
    reason_decode: Reason = Reason.SLO


ONE_TO_THREE = Bounds(1, 3)


def _running(prefill: int, decode: int, draining: dict[str, int] | None = None) -> dict[str, Roster[str]]:
    """Workers by role, every one registered, least loaded first: ``p0``, ``p1``... and ``d0``,
    ``d1``...; ``draining``: how many more of each role are draining."""
    names = {"prefill": [f"p{i}" for i in range(prefill)], "decode": [f"d{i}" for i in range(decode)]}
    return {role: Roster(len(kids), kids, (draining or {}).get(role, 0)) for role, kids in names.items()}


def test_no_advice_does_nothing_whatever_the_fleet() -> None:
    assert reconcile(None, _running(0, 9), ONE_TO_THREE) == []


def test_a_rise_starts_every_worker_missing_at_once() -> None:
    actions = reconcile(Advice(3, 2), _running(1, 1), ONE_TO_THREE)
    assert actions == [Start("prefill"), Start("prefill"), Start("decode")]


def test_the_advice_is_clamped_to_the_bounds() -> None:
    assert reconcile(Advice(10, 0), _running(3, 1), ONE_TO_THREE) == []
    assert reconcile(Advice(10, 0), _running(2, 2), ONE_TO_THREE) == [Start("prefill"), Drain("decode", "d0")]
    assert reconcile(Advice(0, 0), _running(0, 0), Bounds(2, 4)) == [Start("prefill")] * 2 + [Start("decode")] * 2


def test_a_fall_drains_one_worker_per_role_at_a_time_the_least_loaded() -> None:
    assert reconcile(Advice(1, 1), _running(3, 3), ONE_TO_THREE) == [Drain("prefill", "p0"), Drain("decode", "d0")]
    # One decode worker is draining still: the next decode drain waits for it to leave.
    assert reconcile(Advice(1, 1), _running(2, 2, {"decode": 1}), ONE_TO_THREE) == [Drain("prefill", "p0")]


def test_a_draining_worker_is_not_counted_so_a_rise_meanwhile_starts_another() -> None:
    assert reconcile(Advice(2, 2), _running(2, 1, {"decode": 1}), ONE_TO_THREE) == [Start("decode")]


@pytest.mark.parametrize("hold", sorted(set(Reason) - FALLS))
def test_a_hold_drains_nothing_though_its_count_is_lower(hold: Reason) -> None:
    """``measuring``, ``held`` and ``slo_unreachable`` advise the count registered: 0 at ``up``'s
    start, while its workers load their model. A rise under a hold still starts what is missing."""
    assert reconcile(Advice(0, 0, hold, hold), _running(3, 3), ONE_TO_THREE) == []
    assert reconcile(Advice(0, 3, hold, hold), _running(3, 1), ONE_TO_THREE) == [Start("decode"), Start("decode")]


@pytest.mark.parametrize("fall", sorted(FALLS))
def test_a_measured_fall_drains(fall: Reason) -> None:
    assert reconcile(Advice(1, 3, fall, Reason.HELD), _running(2, 3), ONE_TO_THREE) == [Drain("prefill", "p0")]


def test_a_worker_still_starting_counts_as_running_and_is_never_drained() -> None:
    """Two decode workers started, one registered: the advice of 2 starts none, a fall to 1 drains
    the registered one, and with none registered nothing is drained."""
    one_starting = _running(1, 0) | {"decode": Roster(2, ["d0"])}
    assert reconcile(Advice(1, 2), one_starting, ONE_TO_THREE) == []
    assert reconcile(Advice(1, 1), one_starting, ONE_TO_THREE) == [Drain("decode", "d0")]
    assert reconcile(Advice(1, 1), _running(1, 0) | {"decode": Roster[str](2)}, ONE_TO_THREE) == []


@pytest.mark.parametrize("text", ["0:3", "3:2", "1", "a:b", "1:1001", ":"])
def test_bad_bounds_are_a_usage_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="MIN:MAX"):
        Bounds.parse(text)


def test_bounds_parse() -> None:
    assert Bounds.parse("1:3") == ONE_TO_THREE and Bounds.parse("2:2").clamp(9) == 2


def _up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers(), load_env({}))
    return parser.parse_args(["up", "--engine", "sim", *argv])


SLOS = ("--ttft-slo-ms", "500", "--itl-slo-ms", "50")


def test_up_starts_its_counts_clamped_to_the_bounds() -> None:
    args = _up_args("--autoscale", "2:3", "--prefill", "1", "--decode", "5", *SLOS)
    assert up.worker_counts(args) == (2, 3, 0)
    assert up.worker_counts(_up_args("--autoscale", "1:3", *SLOS)) == (1, 1, 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--prefill-dp", "2", *SLOS), "not with DP groups or --mixed"),
        (("--dp", "2", *SLOS), "not with DP groups or --mixed"),
        (("--mixed", "1", "--prefill", "1", "--decode", "1", *SLOS), "not with DP groups or --mixed"),
        (("--ttft-slo-ms", "500"), "needs --itl-slo-ms"),
        (("--itl-slo-ms", "50", "--ttft-slo-ms", "nan"), "needs --ttft-slo-ms"),
        (("--drain-timeout", "0", *SLOS), "--drain-timeout must be in (0, 86400]"),
    ],
)
def test_up_autoscale_usage_errors_exit_2(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert up.run(_up_args("--autoscale", "1:3", *argv), load_env({})) == 2
    assert message in capsys.readouterr().out


def test_up_refuses_bad_bounds_as_argparse_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _up_args("--autoscale", "3:1")
    assert exit_.value.code == 2 and "1 <= MIN <= MAX" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_autoscaler_starts_and_retires_real_children_to_the_advice(capsys: pytest.CaptureFixture[str]) -> None:
    """The shell on a real supervisor: a rise starts a decode worker; a fall retires the one that
    holds least (SIGTERM: it 'drains' and exits 0), which is removed, not restarted."""
    drains = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
        "print('ready', flush=True); time.sleep(60)"
    )
    supervisor = Supervisor(RestartPolicy(first_delay_s=0.2), command=[sys.executable, "-c", drains])
    fleet = Fleet({role: [supervisor.start(f"{role}0", [])] for role in ("prefill", "decode")})
    advice: list[Advice | None] = [None]
    loads: dict[int, int] = {}

    def start(role: str, index: int) -> Child:
        return supervisor.start(f"{role}{index}", [])

    scaler = Autoscaler(
        supervisor,
        fleet,
        ONE_TO_THREE,
        lambda: advice[0],
        start,
        lambda children: [Standing(registered=True, held=loads.get(c.proc.pid, 0)) for _, c in children],
        grace_s=0.0,
    )
    try:
        scaler.tick()
        assert [c.name for c in supervisor.children] == ["prefill0", "decode0"]  # no advice: nothing
        advice[0] = Advice(1, 2)
        _tick(scaler)
        assert [c.name for c in supervisor.children] == ["prefill0", "decode0", "decode1"]
        decode0, decode1 = fleet.children["decode"]
        wait_all_ready(capsys, 3)  # each child's handler is set
        loads.update({decode0.proc.pid: 5, decode1.proc.pid: 0})
        advice[0] = Advice(1, 1)
        _tick(scaler)
        assert decode1.retiring and not decode0.retiring
        assert decode1.proc.wait(10) == 0
        deadline = time.monotonic() + 10
        while decode1 in supervisor.children:
            assert time.monotonic() < deadline
            _tick(scaler)
            supervisor.watch()
        _tick(scaler)
        assert fleet.children["decode"] == [decode0] and decode1.restarts == 0
    finally:
        supervisor.stop()
    assert re.search(r"^decode1 retired: exited with code 0", capsys.readouterr().out, re.M)


SLEEPS = "import sys, time; sys.exit(2) if 'bad' in sys.argv else print('ready', flush=True); time.sleep(60)"
"""A child that runs (or, given ``bad``, exits 2: its options are wrong)."""


def _scaler(
    supervisor: Supervisor, fleet: Fleet, advice: Advice, standings: dict[int, Standing], **kw: Any
) -> Autoscaler:
    def start(role: str, index: int) -> Child:
        return supervisor.start(f"{role}{index}", [])

    def read(children: Sequence[tuple[str, Child]]) -> list[Standing]:
        return [standings.get(child.proc.pid, Standing(registered=False, held=0)) for _, child in children]

    return Autoscaler(supervisor, fleet, ONE_TO_THREE, lambda: advice, start, read, **kw)


@pytest.mark.timeout(60)
def test_the_autoscaler_drains_neither_a_worker_still_loading_nor_one_within_its_start_grace() -> None:
    """A worker started for a rise and loading its model for longer than the planner's window
    holds nothing: it must not be the one drained (it is not registered yet)."""
    supervisor = Supervisor(command=[sys.executable, "-c", SLEEPS])
    fleet = Fleet({"decode": [supervisor.start("decode0", []), supervisor.start("decode1", [])]})
    decode0, decode1 = fleet.children["decode"]
    scaler = _scaler(supervisor, fleet, Advice(1, 1), {decode0.proc.pid: Standing(True, 5)}, grace_s=3600.0)
    try:
        _tick(scaler)
        assert not decode0.retiring and not decode1.retiring  # both within the grace
        scaler.grace_s = 0.0
        _tick(scaler)
        assert decode0.retiring and not decode1.retiring  # decode1 holds less, but is still loading
        _tick(scaler)
        assert not decode1.retiring  # one drain at a time
    finally:
        supervisor.stop()


@pytest.mark.timeout(60)
def test_a_worker_that_gave_up_is_not_counted_and_its_role_gets_no_more(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 (its options or model are wrong): it runs no worker, so it is neither counted nor
    drained (a retire would mark it draining for ever); one started the same way would fail alike."""
    supervisor = Supervisor(command=[sys.executable, "-c", SLEEPS])
    fleet = Fleet({"decode": [supervisor.start("decode0", []), supervisor.start("decode1", ["bad"])]})
    fleet.children["prefill"] = [supervisor.start("prefill0", [])]
    decode0, decode1 = fleet.children["decode"]
    assert decode1.proc.wait(30) == 2
    supervisor.watch()
    scaler = _scaler(supervisor, fleet, Advice(1, 1), {decode0.proc.pid: Standing(True, 5)}, grace_s=0.0)
    try:
        _tick(scaler)
        assert fleet.children["decode"] == [decode0] and not decode0.retiring and not decode1.retiring
        scaler.read = lambda: Advice(1, 2)
        _tick(scaler)
        assert fleet.children["decode"] == [decode0] and len(supervisor.children) == 3  # none started
    finally:
        supervisor.stop()
    assert "autoscale: decode1 gave up, so no decode worker is started any more" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_the_autoscaler_reads_the_registry_only_with_advice_and_once_for_all_its_workers() -> None:
    """``up``'s watch (which also restarts Redis) waits on each read: no advice, no registry read;
    with advice, the standings of every aged worker of both roles in one call."""
    supervisor = Supervisor(command=[sys.executable, "-c", SLEEPS])
    fleet = Fleet({role: [supervisor.start(f"{role}{i}", []) for i in range(2)] for role in ("prefill", "decode")})
    advice: list[Advice | None] = [None]
    calls: list[list[str]] = []

    def standings(children: Sequence[tuple[str, Child]]) -> list[Standing]:
        calls.append([child.name for _, child in children])
        return [Standing(registered=True, held=0)] * len(children)

    def start(role: str, index: int) -> Child:
        return supervisor.start(f"{role}{index}", [])

    scaler = Autoscaler(supervisor, fleet, ONE_TO_THREE, lambda: advice[0], start, standings, grace_s=0.0)
    try:
        _tick(scaler)
        assert calls == []  # no advice: the registry is not read
        advice[0] = Advice(2, 2)
        _tick(scaler)
        assert calls == [["prefill0", "prefill1", "decode0", "decode1"]]
    finally:
        supervisor.stop()


def test_the_held_reader_reads_every_child_in_one_round_trip(bus_config: BusConfig) -> None:
    client = connect_sync(bus_config.redis_url)
    keys = bus_config.keys
    proc = Supervisor().start("decode0", ["--version"]).proc
    children = [Child(f"decode{i}", ["--worker-id", f"d{i}"], {}, proc) for i in range(3)]
    client.hset(keys.worker("d1"), mapping={"running": "1", "waiting": "1"})
    client.set(keys.lease("d1"), "1", px=60_000)
    client.set(keys.lease("d2"), "1", px=60_000)
    trips: list[object] = []
    real_pipeline = client.pipeline

    def counted(*args: Any, **kwargs: Any) -> Any:
        trips.append(args)
        return real_pipeline(*args, **kwargs)

    client.pipeline = counted  # type: ignore[method-assign]
    try:
        read = held_reader(client, keys)([("decode", c) for c in children])
        assert read == [Standing(False, 0), Standing(True, 2), Standing(True, 0)] and len(trips) == 1
        assert held_reader(client, keys)([]) == [] and len(trips) == 1  # none to read: no round trip
    finally:
        proc.wait(30)
        client.close()


def _tick(scaler: Autoscaler) -> None:
    """A tick that acts now (they are at most every READ_EVERY_S)."""
    scaler._next_read = 0.0
    scaler.tick()


def test_the_readers_take_a_forged_or_missing_hash_as_nothing_and_say_so_once(bus_config: BusConfig) -> None:
    client = connect_sync(bus_config.redis_url)
    keys, said = bus_config.keys, []
    read = advice_reader(client, keys, said.append)
    assert read() is None and said == []  # no planner: no advice, nothing to say
    client.hset(keys.planner, mapping={"desired_prefill": "-1"})
    assert read() is None and read() is None
    assert len(said) == 1 and said[0].startswith("autoscale: no advice read (DecodeError")
    held = held_reader(client, keys)
    child = Supervisor().start("decode0", ["--version"])
    try:
        worker = keys.worker(default_worker_id("decode", child.proc.pid))
        client.hset(worker, mapping={"running": "3", "waiting": "2"})
        assert held([("decode", child)]) == [Standing(registered=False, held=5)]  # no lease: still loading
        client.set(keys.lease(default_worker_id("decode", child.proc.pid)), "1", px=60_000)
        assert held([("decode", child)]) == [Standing(registered=True, held=5)]
        client.hset(worker, mapping={"running": "x" * 40, "waiting": "-7"})
        assert held([("decode", child)]) == [Standing(registered=True, held=0)]
    finally:
        child.proc.wait(30)
        client.close()


@pytest.mark.parametrize("given", [["--worker-id", "d-fixed"], ["--worker-id=other", "--worker-id=d-fixed"]])
def test_the_held_reader_reads_the_worker_id_the_child_was_started_with(
    bus_config: BusConfig, given: list[str]
) -> None:
    """``up --worker-arg=--worker-id=...``: the worker registers under that id, not its pid's."""
    client = connect_sync(bus_config.redis_url)
    keys = bus_config.keys
    held = held_reader(client, keys)
    child = Supervisor().start("decode0", ["--version"])
    try:
        named = Child("decode0", ["worker", "--role", "decode", *given], {}, child.proc)
        client.hset(keys.worker("d-fixed"), mapping={"running": "4", "waiting": "0"})
        client.set(keys.lease("d-fixed"), "1", px=60_000)
        assert held([("decode", named)]) == [Standing(registered=True, held=4)]
    finally:
        child.proc.wait(30)
        client.close()
