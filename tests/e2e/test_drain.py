"""Draining a worker under load (SIGTERM with --drain-timeout), real processes: every stream's
text is exact (the sim engine's, so known), none lost, none duplicated; the worker leaves the
registry and exits 0; no task is written to it once its flag is in its hash.

`up` runs one P and one D; the test starts a second D of its own (a child of `up` would be
restarted when it exits), so that the streams spread over two decode workers and the signal
reaches the one it means."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from splitbus.bus.core.keys import Keys
from splitbus.redis_server import embedded_url
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system
from tests.faults.conftest import Part, wait_until
from tests.faults.kills import moved_tasks, streams_with_a_kill

STEP_ARG = "--sim-decode-step-ms=25"
"""25 ms per decode step: a 200-token stream takes ~5 s, so a signal 1 s in finds them mid-stream."""


@dataclass
class Fleet:
    system: System
    data_dir: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    data_dir = tmp_path_factory.mktemp("up")
    system = start_system(data_dir, "--prefill", "1", "--decode", "1", f"--worker-arg={STEP_ARG}")
    yield Fleet(system, data_dir)
    assert stop_system(system) == []


def _worker(fleet: Fleet, role: str, worker_id: str, drain_timeout_s: float, slow: str = STEP_ARG) -> Part:
    """A worker beside `up`'s, on its Redis with the workers' own user (not `up`'s child)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLITBUS_REDIS_URL": embedded_url(fleet.data_dir / "redis") or ""}
    env.pop("SPLITBUS_PREFIX", None)
    args = ["--role", role, "--engine", "sim", "--served-model-name", "tiny", "--worker-id", worker_id]
    model = fleet.data_dir / "models" / "tiny"
    command = [sys.executable, "-m", "splitbus.cli.main", "worker", *args, "--model", str(model), slow]
    proc = subprocess.Popen(
        [*command, "--drain-timeout", str(drain_timeout_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    part = Part(proc)
    part.reader = threading.Thread(target=part.output.extend, args=(proc.stdout,), daemon=True)
    part.reader.start()
    assert part.wait_for_log(f"worker {worker_id} .* ready", 60), part.log()
    return part


def _drain_under_load(
    fleet: Fleet, part: Part, worker_id: str, first_seed: int, max_tokens: int = 200, letter: int = 97
) -> Part:
    """16 streams over both workers of ``part``'s role (prompts of ``letter``); SIGTERM to it once a
    task was written to it. Every text is exact; it exits 0 and leaves the registry."""
    try:
        term = functools.partial(_term_once_tasked, fleet, part, worker_id)
        streams = streams_with_a_kill(
            fleet.system,
            16,
            max_tokens,
            100,
            "",
            after_s=0.5,
            first_seed=first_seed,
            timeout_s=50,
            act=term,
            letter=letter,
        )
        texts = asyncio.run(streams)
        assert texts == [sim_text(first_seed + i, max_tokens) for i in range(16)]
        assert part.wait(40) == 0, part.log()
    finally:
        part.stop()
    r = fleet.system.redis()
    assert r.zscore(Keys().workers, worker_id) is None
    return part


def _term_once_tasked(fleet: Fleet, part: Part, worker_id: str) -> None:
    """SIGTERM once a task has been written to the worker (bounded): the drain has work to do."""
    r = fleet.system.redis()
    tasked = wait_until(
        lambda: r.exists(Keys().tasks(worker_id)) and r.xinfo_stream(Keys().tasks(worker_id))["entries-added"], 10
    )
    assert tasked, f"no task was written to {worker_id}"
    part.proc.send_signal(signal.SIGTERM)


def _had_work(part: Part, timeout_s: float) -> bool:
    """Whether the worker held requests, or had tasks not yet done, when the signal came."""
    found = re.search(rf"up to {timeout_s:.1f} s to finish (\d+) requests and (-?\d+) tasks not yet done", part.log())
    return found is not None and max(int(found.group(1)), int(found.group(2))) > 0


def _flag_ms(fleet: Fleet, worker_id: str) -> int:
    """When the worker's draining flag reached its hash: its first registry-log entry saying so."""
    for entry_id, fields in fleet.system.redis().xrange(Keys().registry_log):
        if fields.get("w") == worker_id and fields.get("draining") == "1":
            return int(entry_id.split("-")[0])
    raise AssertionError(f"{worker_id} never logged its draining flag")


def _last_task_ms(fleet: Fleet, worker_id: str) -> int:
    """When the last task ever written to the worker's stream was (trimmed entries count too)."""
    info = fleet.system.redis().xinfo_stream(Keys().tasks(worker_id))
    return int(str(info["last-generated-id"]).split("-")[0])


@pytest.mark.timeout(120)
def test_a_drained_decode_worker_finishes_its_streams_and_leaves(fleet: Fleet) -> None:
    part = _drain_under_load(fleet, _worker(fleet, "decode", "d-drain", 30), "d-drain", first_seed=700)
    assert _had_work(part, 30), part.log()
    assert "drained: leaving the registry" in part.log() and "handed over by migration" not in part.log()
    assert _last_task_ms(fleet, "d-drain") <= _flag_ms(fleet, "d-drain")
    tasks_before = fleet.system.redis().xinfo_stream(Keys().tasks("d-drain"))["entries-added"]
    later = asyncio.run(streams_with_a_kill(fleet.system, 4, 20, 20, "", after_s=0, first_seed=800, act=lambda: None))
    assert later == [sim_text(800 + i, 20) for i in range(4)]
    assert fleet.system.redis().xinfo_stream(Keys().tasks("d-drain"))["entries-added"] == tasks_before


@pytest.mark.timeout(120)
def test_past_its_drain_timeout_what_a_worker_holds_migrates_exactly(fleet: Fleet) -> None:
    since = len(fleet.system.output)
    part = _drain_under_load(fleet, _worker(fleet, "decode", "d-short", 0.5), "d-short", first_seed=900)
    assert part.wait_for_log(r"drained: [1-9]\d* requests handed over by migration after 0.5 s", 1), part.log()
    assert moved_tasks(fleet.system, since) > 0


@pytest.mark.timeout(120)
def test_a_drained_prefill_worker_hands_off_what_it_holds_and_leaves(fleet: Fleet) -> None:
    """Our prefill worker is slow (2 ms a prompt token): the signal finds prompts queued and
    prefilling on it; each is prefilled and handed off before it leaves."""
    slow = _worker(fleet, "prefill", "p-drain", 30, slow="--sim-prefill-us-per-token=2000")
    # Prompts of their own: `up`'s prefill worker has cached the others, and would draw them all.
    part = _drain_under_load(fleet, slow, "p-drain", first_seed=1100, max_tokens=20, letter=65)
    assert _had_work(part, 30), part.log()
    assert "drained: leaving the registry" in part.log() and "handed over by migration" not in part.log()
    assert _last_task_ms(fleet, "p-drain") <= _flag_ms(fleet, "p-drain")


async def _burst(system: System, seconds: int, per_second: int, first_seed: int) -> list[str]:
    """``per_second`` streams of 200-token prompts (10 tokens each) started every second for
    ``seconds``; their texts in order. Each second's prompts are of their own letter: uncached."""
    batches = []
    for k in range(seconds):
        seed = first_seed + per_second * k
        batch = streams_with_a_kill(
            system, per_second, 10, 200, "", after_s=0, first_seed=seed, act=lambda: None, letter=65 + k
        )
        batches.append(asyncio.ensure_future(batch))
        await asyncio.sleep(1)
    return [text for batch in batches for text in await batch]


@pytest.mark.timeout(120)
def test_up_autoscale_starts_a_worker_for_a_burst_and_drains_one_after_it(tmp_path: Path) -> None:
    """`up --autoscale 1:2` with the planner deciding every second: a burst beyond one prefill
    worker's 500 tokens/s (2 ms a token) starts a second; once it is over, one of the two is
    drained and retired (not restarted). Every stream is exact throughout."""
    system = start_system(
        tmp_path,
        "--autoscale",
        "1:2",
        "--ttft-slo-ms",
        "1000",
        "--itl-slo-ms",
        "100",
        "--planner-arg=--interval-s=1",
        "--planner-arg=--scale-down-window-s=2",
        "--worker-arg=--sim-prefill-us-per-token=2000",
    )
    try:
        texts = asyncio.run(_burst(system, 6, 4, first_seed=2000))
        assert texts == [sim_text(2000 + i, 10) for i in range(24)]
        system.wait_output(r"^prefill1 +\| .* worker prefill-\S+ \(prefill\) ready", 1)
        retired = system.wait_output(r"^(prefill\d) retired: exited with code 0", 30)
        r = system.redis()
        roles = sorted(r.hget(Keys().worker(w), "role") for w in r.zrange(Keys().workers, 0, -1))
        assert roles == ["decode", "prefill"]
        assert f"{retired.group(1)} restarted" not in "".join(system.output)
    finally:
        assert stop_system(system) == []
