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
from tests.faults.conftest import Part
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


def _decode_worker(fleet: Fleet, worker_id: str, drain_timeout_s: float) -> Part:
    """A decode worker beside `up`'s, on its Redis with the workers' own user (not `up`'s child)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLITBUS_REDIS_URL": embedded_url(fleet.data_dir / "redis") or ""}
    env.pop("SPLITBUS_PREFIX", None)
    args = ["--role", "decode", "--engine", "sim", "--served-model-name", "tiny", "--worker-id", worker_id]
    model = fleet.data_dir / "models" / "tiny"
    command = [sys.executable, "-m", "splitbus.cli.main", "worker", *args, "--model", str(model), STEP_ARG]
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


def _drain_under_load(fleet: Fleet, worker_id: str, drain_timeout_s: float, first_seed: int) -> Part:
    """16 streams of 200 tokens over both decode workers; SIGTERM to ours 1 s in. Every text is
    exact; ours exits 0 and leaves the registry."""
    part = _decode_worker(fleet, worker_id, drain_timeout_s)
    try:
        term = functools.partial(part.proc.send_signal, signal.SIGTERM)
        streams = streams_with_a_kill(
            fleet.system, 16, 200, 20, "", after_s=1.0, first_seed=first_seed, timeout_s=50, act=term
        )
        texts = asyncio.run(streams)
        assert texts == [sim_text(first_seed + i, 200) for i in range(16)]
        assert part.wait(40) == 0, part.log()
    finally:
        part.stop()
    r = fleet.system.redis()
    assert r.zscore(Keys().workers, worker_id) is None
    return part


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
    part = _drain_under_load(fleet, "d-drain", 30, first_seed=700)
    started = part.wait_for_log(r"draining: no new task; up to 30.0 s to finish ([1-9]\d*) requests", 1)
    assert started, part.log()  # it held streams when the signal came
    assert "drained: leaving the registry" in part.log() and "handed over by migration" not in part.log()
    assert _last_task_ms(fleet, "d-drain") <= _flag_ms(fleet, "d-drain")
    tasks_before = fleet.system.redis().xinfo_stream(Keys().tasks("d-drain"))["entries-added"]
    later = asyncio.run(streams_with_a_kill(fleet.system, 4, 20, 20, "", after_s=0, first_seed=800, act=lambda: None))
    assert later == [sim_text(800 + i, 20) for i in range(4)]
    assert fleet.system.redis().xinfo_stream(Keys().tasks("d-drain"))["entries-added"] == tasks_before


@pytest.mark.timeout(120)
def test_past_its_drain_timeout_what_a_worker_holds_migrates_exactly(fleet: Fleet) -> None:
    since = len(fleet.system.output)
    part = _drain_under_load(fleet, "d-short", 0.5, first_seed=900)
    assert part.wait_for_log(r"drained: [1-9]\d* requests handed over by migration after 0.5 s", 1), part.log()
    assert moved_tasks(fleet.system, since) > 0
