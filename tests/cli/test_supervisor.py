"""The supervisor of `splitbus up` restarts a child that dies, after a capped exponential
backoff, with a line naming it, how it ended and the wait; real processes, real signals."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from splitbus.cli.supervisor import RestartPolicy, Supervisor

FAST = RestartPolicy(first_delay_s=0.2, max_delay_s=0.8, stable_s=5.0)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _watch_for(supervisor: Supervisor, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert supervisor.watch() is None
        time.sleep(0.02)


def _wait_printed(capsys: pytest.CaptureFixture[str], text: str) -> str:
    seen, deadline = "", time.monotonic() + 20
    while text not in seen:
        assert time.monotonic() < deadline, f"{text!r} never printed: {seen}"
        time.sleep(0.05)
        seen += capsys.readouterr().out
    return seen


def wait_all_ready(capsys: pytest.CaptureFixture[str], children: int) -> None:
    """Until each child printed 'ready' (its signal handlers are set)."""
    seen = ""
    while seen.count("ready") < children:
        seen += _wait_printed(capsys, "ready")


def _waits(out: str, name: str) -> list[float]:
    return [float(w) for w in re.findall(rf"^{name} .*; restarting it in ([\d.]+)s", out, re.M)]


@pytest.mark.timeout(60)
def test_a_child_that_crashes_at_once_is_restarted_with_backoff_not_spun(capsys: pytest.CaptureFixture[str]) -> None:
    supervisor = Supervisor(FAST, command=_python("import sys; sys.exit(3)"))
    child = supervisor.start("crasher", [])
    pids = {child.proc.pid}
    try:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            supervisor.watch()
            pids.add(child.proc.pid)
            time.sleep(0.02)
    finally:
        supervisor.stop()
    out = capsys.readouterr().out
    waits = _waits(out, "crasher")
    assert waits[:4] == [0.2, 0.4, 0.8, 0.8], out  # doubling, then capped
    # 4 s with waits of 0.2 + 0.4 + 0.8 + 0.8 + ...: a handful of starts, not hundreds.
    assert 4 <= len(pids) <= 8, out
    assert "crasher exited with code 3 after" in out and re.search(r"crasher restarted \(pid \d+\)", out)


@pytest.mark.timeout(60)
def test_the_wait_resets_after_a_stable_run(capsys: pytest.CaptureFixture[str]) -> None:
    policy = RestartPolicy(first_delay_s=0.2, max_delay_s=5.0, stable_s=0.3)
    supervisor = Supervisor(policy, command=_python("import time, sys; time.sleep(0.5); sys.exit(1)"))
    supervisor.start("steady", [])
    try:
        _watch_for(supervisor, 3.5)
    finally:
        supervisor.stop()
    waits = _waits(capsys.readouterr().out, "steady")
    assert len(waits) >= 3 and set(waits) == {0.2}, waits  # each run outlived stable_s


@pytest.mark.timeout(60)
def test_a_killed_child_is_named_with_its_signal_and_comes_back_with_its_environment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = "import os, time; print('secret', os.environ['SB_TEST_SECRET'] == 'hush', flush=True); time.sleep(60)"
    supervisor = Supervisor(FAST, command=_python(code))
    child = supervisor.start("worker0", [], {"SB_TEST_SECRET": "hush"})
    try:
        first = child.proc.pid
        seen = _wait_printed(capsys, "secret")
        os.kill(first, signal.SIGKILL)
        _watch_for(supervisor, 1.0)
        assert child.proc.pid != first and child.proc.poll() is None and child.restarts == 1
        seen += _wait_printed(capsys, "secret")
    finally:
        supervisor.stop()
    out = seen + capsys.readouterr().out
    line = r"^worker0 was killed by SIGKILL after [\d.]+s; restarting it in 0.2s \(restart 1\)$"
    assert re.search(line, out, re.M), out
    assert out.count("worker0   | secret True") == 2, out  # the restarted one got the environment too


@pytest.mark.timeout(60)
def test_exit_code_2_is_not_restarted_and_an_api_that_cannot_start_stops_the_system(
    capsys: pytest.CaptureFixture[str],
) -> None:
    supervisor = Supervisor(FAST, command=_python("import sys; sys.exit(2)"))
    api = supervisor.start("api", [])
    api.proc.wait(30)
    try:
        assert supervisor.watch() == "the API cannot start"
        time.sleep(0.5)
        assert supervisor.watch() == "the API cannot start" and api.restarts == 0
    finally:
        supervisor.stop()
    assert "api exited with code 2 (its options or model are wrong): not restarted" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_stop_during_a_pending_restart_restarts_nothing_and_ends_a_stopped_child_promptly() -> None:
    supervisor = Supervisor(RestartPolicy(first_delay_s=0.3), command=_python("import time; time.sleep(60)"))
    dying, frozen = supervisor.start("decode0", []), supervisor.start("prefill0", [])
    os.kill(dying.proc.pid, signal.SIGKILL)
    dying.proc.wait(10)
    assert supervisor.watch() is None and dying.restart_at is not None  # its restart is pending
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    supervisor.stop()
    assert time.monotonic() - started < 5  # not the 10 s SIGKILL fallback: SIGCONT let SIGTERM act
    assert frozen.proc.returncode == -signal.SIGTERM
    time.sleep(0.5)
    assert supervisor.watch() is None and dying.restarts == 0 and dying.proc.poll() is not None


@pytest.mark.timeout(60)
def test_an_exit_code_with_a_meaning_is_said_with_it(capsys: pytest.CaptureFixture[str]) -> None:
    supervisor = Supervisor(FAST, command=_python("import sys; sys.exit(3)"))
    supervisor.start("rank0", [], exits={3: "DP group g0 is broken"})
    supervisor.start("other", [])
    out, deadline = "", time.monotonic() + 20
    try:
        while out.count("exited with code 3") < 2:
            assert time.monotonic() < deadline, out
            supervisor.watch()
            time.sleep(0.02)
            out += capsys.readouterr().out
    finally:
        supervisor.stop()
    assert re.search(
        r"^rank0 exited with code 3 \(DP group g0 is broken\) after [\d.]+s; restarting it in", out, re.M
    ), out
    assert re.search(r"^other exited with code 3 after", out, re.M), out


@pytest.mark.timeout(60)
def test_children_that_ignore_sigterm_are_killed_after_one_wait_for_all(capsys: pytest.CaptureFixture[str]) -> None:
    """``up``'s Ctrl-C: the timeout is one wait shared by all the children, not one each in turn
    (six lingering DP ranks took a minute)."""
    ignore = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    )
    supervisor = Supervisor(FAST, command=_python(ignore))
    children = [supervisor.start(f"rank{i}", []) for i in range(3)]
    out, deadline = "", time.monotonic() + 20
    while out.count("| ready") < 3:
        assert time.monotonic() < deadline, out
        time.sleep(0.05)
        out += capsys.readouterr().out
    started = time.monotonic()
    supervisor.stop(timeout_s=1.0)
    assert time.monotonic() - started < 2.5  # not 3 x 1 s
    assert [c.proc.returncode for c in children] == [-signal.SIGKILL] * 3
    out += capsys.readouterr().out
    assert sorted(re.findall(r"^(rank\d) did not stop within 1 s of SIGTERM: killed$", out, re.M)) == [
        "rank0",
        "rank1",
        "rank2",
    ]


@pytest.mark.timeout(60)
def test_a_retired_child_gets_sigterm_and_is_removed_not_restarted(capsys: pytest.CaptureFixture[str]) -> None:
    """A drained worker's end: SIGTERM (it drains, then exits 0), and its exit restarts nothing."""
    drains = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
        "print('ready', flush=True); time.sleep(60)"
    )
    supervisor = Supervisor(FAST, command=_python(drains))
    leaving, staying = supervisor.start("decode1", []), supervisor.start("decode0", [])
    try:
        wait_all_ready(capsys, 2)
        supervisor.retire(leaving)
        assert leaving.proc.wait(10) == 0
        _watch_for(supervisor, 1.0)
        assert supervisor.children == [staying] and leaving.restarts == 0 and staying.proc.poll() is None
    finally:
        supervisor.stop()
    out = capsys.readouterr().out
    assert re.search(r"^decode1 retired: exited with code 0 after [\d.]+s$", out, re.M), out
    assert "restarting" not in out


@pytest.mark.timeout(60)
def test_a_child_retired_while_it_waits_to_restart_is_removed_at_once_not_restarted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A worker that crashed is dead: there is nothing to signal, and a restart would bring back
    a worker marked retiring that no one signalled (its role never drains again)."""
    supervisor = Supervisor(RestartPolicy(first_delay_s=30.0), command=_python("import sys; sys.exit(3)"))
    crashed = supervisor.start("decode1", [])
    try:
        crashed.proc.wait(10)
        supervisor.watch()
        assert crashed.restart_at is not None  # it waits to restart
        supervisor.retire(crashed)
        assert supervisor.children == [] and crashed.restart_at is None
        _watch_for(supervisor, 0.3)
        assert crashed.restarts == 0
    finally:
        supervisor.stop()
    assert re.search(r"^decode1 retired: exited with code 3 after [\d.]+s$", capsys.readouterr().out, re.M)


@pytest.mark.timeout(60)
def test_a_child_that_gave_up_is_removed_at_once_when_retired() -> None:
    supervisor = Supervisor(FAST, command=_python("import sys; sys.exit(2)"))
    wrong = supervisor.start("decode1", [])
    try:
        wrong.proc.wait(10)
        supervisor.watch()
        assert wrong.gave_up
        supervisor.retire(wrong)
        assert supervisor.children == []
    finally:
        supervisor.stop()


@pytest.mark.timeout(60)
def test_stop_sends_each_child_its_own_stop_signal(capsys: pytest.CaptureFixture[str]) -> None:
    """A worker on which SIGTERM drains is stopped with SIGINT: `up`'s own stop stays seconds."""
    # A process started in the background inherits SIGINT ignored, and Python then leaves it so (a
    # worker sets its own handler: cli/common.py run_service); the child takes it as a worker does.
    child = "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); print('ready', flush=True)"
    supervisor = Supervisor(FAST, command=_python(child + "; time.sleep(60)"))
    worker = supervisor.start("decode0", [], stop_signal=signal.SIGINT)
    api = supervisor.start("api", [])
    wait_all_ready(capsys, 2)
    supervisor.stop()
    assert worker.proc.returncode == -signal.SIGINT  # Python ends an uncaught KeyboardInterrupt so
    assert api.proc.returncode == -signal.SIGTERM
