"""`splitbus up` restarts a part that dies (worker, scheduler, API), with a line naming it, its
signal and the wait; secrets still reach the restarted part through its environment only; Ctrl-C
still stops everything, even with a restart pending; if the embedded Redis dies, `up` stops."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest
import redis

from splitbus.cli.cluster_up import MAX_NODE_RESTARTS
from splitbus.worker.engines.sim import sim_text
from tests.cli.test_secrets import _environ
from tests.e2e.conftest import System, _cmdline, alive, start_system, stop_system

KEY = "sk-restart-0123456789-secret"


def _kill_and_see_restart(system: System, name: str, pattern: str) -> int:
    old = system.pid_of(pattern)
    mark = len(system.output)
    os.kill(old, signal.SIGKILL)
    system.wait_output(rf"^{name} was killed by SIGKILL after [\d.]+s; restarting it in 0\.5s \(restart 1\)$", 10, mark)
    new = int(system.wait_output(rf"^{name} restarted \(pid (\d+)\)$", 10, mark).group(1))
    assert new != old and new in system.pids_of(pattern)
    return new


def _completes(system: System, seed: int, timeout_s: float = 40.0) -> None:
    """A request succeeds, exactly, within the bound (the API may still be starting: its port
    refuses connections). One it took and never answered is lost: a failure, not a retry."""
    client = openai.OpenAI(base_url=system.v1, api_key=KEY, max_retries=0, timeout=30)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = client.completions.create(model="tiny", prompt="r", max_tokens=6, seed=seed).choices[0].text
            assert text == sim_text(seed, 6)
            return
        except openai.APITimeoutError:
            raise AssertionError(f"request {seed} was taken and never answered") from None
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, "the API never came back"
            time.sleep(0.2)


@pytest.mark.timeout(180)
def test_up_restarts_each_kind_of_part(tmp_path: Path) -> None:
    system = start_system(tmp_path, "--request-timeout", "60", environ={"SPLITBUS_API_KEYS": KEY})
    try:
        _completes(system, 1)
        for seed, (name, pattern) in enumerate(
            [
                ("decode0", r"--role decode"),
                ("prefill0", r"--role prefill"),
                ("scheduler", r"main scheduler "),
                ("api", r"main api "),
            ],
            2,
        ):
            _kill_and_see_restart(system, name, pattern)
            _completes(system, seed)
        api = system.pid_of(r"main api ")
        assert _environ(api)["SPLITBUS_API_KEYS"] == KEY and KEY not in _cmdline(api)
        assert all(KEY not in _cmdline(pid) for pid in system.descendants())
        assert KEY not in "".join(system.output)
    except BaseException:
        print("".join(system.output))  # the parts' own lines say what went wrong
        raise
    finally:
        assert stop_system(system) == []


@pytest.mark.timeout(120)
def test_ctrl_c_with_a_restart_pending_stops_everything(tmp_path: Path) -> None:
    system = start_system(tmp_path)
    mark = len(system.output)
    os.kill(system.pid_of(r"--role decode"), signal.SIGKILL)
    system.wait_output(r"^decode0 was killed by SIGKILL", 10, mark)  # its restart waits 0.5 s
    started = time.monotonic()
    assert stop_system(system) == []
    assert time.monotonic() - started < 20
    assert system.proc.returncode == 0
    time.sleep(0.3)  # the relay threads' last lines
    out = "".join(system.output[mark:])
    assert "restarted" not in out[out.index("stopped (SIGINT)") :], out  # nothing started once stopping


@pytest.mark.timeout(120)
def test_up_starts_its_embedded_redis_again_then_stops_when_it_keeps_dying(tmp_path: Path) -> None:
    system = start_system(tmp_path)
    parts = system.descendants()
    try:
        for restart in range(MAX_NODE_RESTARTS):
            mark = len(system.output)
            os.kill(system.pid_of(r"redis-server"), signal.SIGKILL)
            system.wait_output(r"^the embedded Redis \(port \d+\) exited: starting it again from its data", 10, mark)
            system.wait_output(r"^the embedded Redis is back on port \d+$", 10, mark)
            assert system.proc.poll() is None, f"up stopped at restart {restart + 1}"
            _until_redis_answers(system.redis_url)  # on its port and password
        os.kill(system.pid_of(r"redis-server"), signal.SIGKILL)
        assert system.proc.wait(30) == 1
    finally:
        if system.proc.poll() is None:  # failed before up stopped itself: the system is not left running
            stop_system(system)
    system.wait_output(
        rf"^stopped \(the embedded Redis exited {MAX_NODE_RESTARTS + 1} times; its log: .*redis\.log\)$", 5
    )
    deadline = time.monotonic() + 10
    while any(alive(p) for p in parts) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in parts if alive(p)]


def _until_redis_answers(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    with redis.Redis.from_url(url, socket_timeout=1) as client:
        while True:
            try:
                client.ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_kills_the_parts_without_a_traceback(tmp_path: Path) -> None:
    # An impatient operator presses Ctrl-C again while the parts stop: `up` used to end with a
    # KeyboardInterrupt traceback from inside its stop, the parts left to stop (or not) alone.
    system = start_system(tmp_path)
    parts = system.descendants()
    time.sleep(1.0)  # past the banner: `up` waits for Ctrl-C (one before is only noted, see below)
    system.proc.send_signal(signal.SIGINT)
    time.sleep(0.05)  # the parts are being stopped
    system.proc.send_signal(signal.SIGINT)
    assert system.proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in parts) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in parts if alive(p)]
    time.sleep(0.3)  # the relay threads' last lines
    out = "".join(system.output)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "SIGINT again: killing the parts" in out and "stopped (SIGINT)" in out


@pytest.mark.timeout(120)
def test_ctrl_c_during_the_banner_stops_cleanly(tmp_path: Path) -> None:
    # Ctrl-C at the first line of the banner, before `up` waits for it: it used to end `up` with
    # a KeyboardInterrupt traceback from whatever it was doing (an import), the parts left alone.
    system = start_system(tmp_path)
    assert stop_system(system) == []
    time.sleep(0.3)  # the relay threads' last lines
    out = "".join(system.output)
    assert system.proc.returncode == 0 and "stopped (SIGINT)" in out and "Traceback" not in out, out
