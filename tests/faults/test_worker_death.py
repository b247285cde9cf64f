"""kill -9 a worker while requests run on it: every stream still completes exactly (sim engine,
so the expected text is known), with no duplicate and no gap."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from pathlib import Path

import pytest

from splitbus.bus.keys import Keys
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system
from tests.faults.kills import streams_with_a_kill

_streams = functools.partial(streams_with_a_kill, first_seed=500)


def _moved(system: System) -> int:
    """Tasks the reaper moved, from the scheduler's log (it logs each dead worker it takes)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = re.findall(r"is dead: moved (\d+) task", "".join(system.output))
        if found:
            return sum(map(int, found))
        time.sleep(0.2)
    return 0


@pytest.mark.timeout(180)
def test_decode_worker_killed_mid_stream(tmp_path: Path, bus_environ: dict[str, str]) -> None:
    # 25 ms per decode step: 120 tokens take ~3 s, and the kill lands 1 s in. On a single Redis and on a cluster.
    args = ("--decode", "2", "--worker-arg=--sim-decode-step-ms", "--worker-arg=25")
    system = start_system(tmp_path, *args, environ=bus_environ)
    try:
        started = time.monotonic()
        texts = asyncio.run(_streams(system, 40, 120, 8, after_s=1.0, victim=r"--role decode"))
        assert texts == [sim_text(500 + i, 120) for i in range(40)]
        assert time.monotonic() - started < 60
        assert _moved(system) > 0
        r = system.redis()
        live = {r.hget(Keys().worker(w), "role") for w in r.zrange(Keys().workers, 0, -1)}
        assert sorted(live) == ["decode", "prefill"]  # the dead one left the live set...
        dead = [k for k in r.scan_iter("sb:worker:*") if r.hget(k, "state") == "dead"]
        assert len(dead) == 1 and r.hget(dead[0], "reserved_kv_blocks") == "0" and 0 < r.ttl(dead[0]) <= 3600
    finally:
        stop_system(system)


@pytest.mark.timeout(180)
def test_prefill_worker_killed_mid_prefill(tmp_path: Path) -> None:
    # 2 ms per prompt token: each prefill worker's batch of 100-token prompts takes ~1 s.
    system = start_system(tmp_path, "--prefill", "2", "--worker-arg=--sim-prefill-us-per-token", "--worker-arg=2000")
    try:
        texts = asyncio.run(_streams(system, 10, 20, 100, after_s=0.4, victim=r"--role prefill"))
        assert texts == [sim_text(500 + i, 20) for i in range(10)]
        assert _moved(system) > 0
    finally:
        stop_system(system)
