"""kill -9 a worker while requests run on it: every stream still completes exactly (sim engine,
so the expected text is known), with no duplicate and no gap, its logprobs too."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitbus.bus.core.keys import Keys
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system
from tests.faults.kills import moved_tasks, streams_with_a_kill

_streams = functools.partial(streams_with_a_kill, first_seed=500)


DECODE_ARGS = ("--decode", "2", "--worker-arg=--sim-decode-step-ms=25")
"""25 ms per decode step: 80 tokens take ~2 s."""
PREFILL_ARGS = ("--prefill", "2", "--worker-arg=--sim-prefill-us-per-token=2000")
"""2 ms per prompt token: each prefill worker's batch of 100-token prompts takes ~1 s."""


@pytest.fixture(scope="module")
def two_of_each(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    """One `up` on its own single Redis, two workers of each role, both slowed, for both tests
    there (a CI-time cut: one start, not two). `up` restarts the killed worker, so each test
    finds two live workers of each role; each reads `up`'s output from where it began."""
    system = start_system(tmp_path_factory.mktemp("up"), *DECODE_ARGS, *PREFILL_ARGS)
    yield system
    stop_system(system)


@pytest.mark.timeout(180)
def test_decode_worker_killed_mid_stream(
    tmp_path: Path, bus_environ: dict[str, str], request: pytest.FixtureRequest
) -> None:
    """On a single Redis (the module's `up`) and on a cluster (one of its own, two decode
    workers): 80 tokens take ~2 s, and the kill lands 1 s in, mid-stream (it was 120 tokens: a
    CI-time cut of ~1 s a run, the same migration of half-written streams)."""
    if bus_environ:
        system = start_system(tmp_path, *DECODE_ARGS, environ=bus_environ)
        try:
            _decode_worker_killed_mid_stream(system)
        finally:
            stop_system(system)
    else:
        _decode_worker_killed_mid_stream(request.getfixturevalue("two_of_each"))


def _decode_worker_killed_mid_stream(system: System) -> None:
    since, started = len(system.output), time.monotonic()
    victim = system.pid_of(r"--role decode")  # the one _streams kills: its id ends in the pid
    texts = asyncio.run(_streams(system, 40, 80, 8, after_s=1.0, victim=r"--role decode", logprobs=2))
    assert texts == [sim_text(500 + i, 80) for i in range(40)]
    assert time.monotonic() - started < 60
    assert moved_tasks(system, since) > 0
    r = system.redis()
    live = {r.hget(Keys().worker(w), "role") for w in r.zrange(Keys().workers, 0, -1)}
    assert sorted(live) == ["decode", "prefill"]  # the dead one left the live set...
    dead = [k for k in r.scan_iter("sb:worker:*") if r.hget(k, "state") == "dead" and k.endswith(f"-{victim}")]
    assert len(dead) == 1 and r.hget(dead[0], "reserved_kv_blocks") == "0" and 0 < r.ttl(dead[0]) <= 3600


@pytest.mark.timeout(180)
def test_prefill_worker_killed_mid_prefill(two_of_each: System) -> None:
    since = len(two_of_each.output)
    texts = asyncio.run(_streams(two_of_each, 10, 20, 100, after_s=0.4, victim=r"--role prefill"))
    assert texts == [sim_text(500 + i, 20) for i in range(10)]
    assert moved_tasks(two_of_each, since) > 0


@pytest.mark.timeout(180)
def test_decode_worker_killed_mid_stream_with_the_api_dispatching(tmp_path: Path) -> None:
    """The reaper moves the tasks an API node wrote as it moves a scheduler's."""
    system = start_system(tmp_path, *DECODE_ARGS, "--dispatch", "api")
    try:
        _decode_worker_killed_mid_stream(system)
    finally:
        stop_system(system)
