"""The randomized fault run of issue 17: `splitbus up --engine sim --prefill 2 --decode 2
--schedulers 2` with slowed prefills, streams flowing continuously, and about 10 faults drawn
from a seed (kill -9, or SIGSTOP for a few seconds then SIGCONT, of a prefill worker, a decode
worker or a scheduler replica; `up` restarts what dies). Every admitted request must complete
with exactly the text of a clean run of its seed. The seed is printed, and named in a failure:
replay with ``SPLITBUS_FAULT_SEED=<seed> pytest tests/faults/test_fault_run.py``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import redis

from tests.e2e.conftest import start_system, stop_system
from tests.faults.fault_run import FaultRun, RunConfig, notable, plan, request, stuck_tasks, summary, traces

DEFAULT_SEED = 17


def _config() -> RunConfig:
    return RunConfig(seed=int(os.environ.get("SPLITBUS_FAULT_SEED", DEFAULT_SEED)))


def test_the_plan_and_the_requests_are_the_seeds() -> None:
    """A replay injects the same faults and sends the same requests."""
    assert plan(RunConfig(seed=5)) == plan(RunConfig(seed=5)) != plan(RunConfig(seed=6))
    assert [request(5, i) for i in range(50)] == [request(5, i) for i in range(50)]
    kinds = {(f.action, f.role) for seed in range(20) for f in plan(RunConfig(seed=seed))}
    assert len(kinds) == 6  # every fault kind on every part occurs


@pytest.mark.timeout(240)
def test_randomized_fault_run(tmp_path: Path) -> None:
    config = _config()
    print(f"fault run seed {config.seed}", flush=True)
    system = start_system(
        tmp_path,
        "--prefill",
        "2",
        "--decode",
        "2",
        "--schedulers",
        "2",
        "--request-timeout",
        "60",
        "--worker-arg=--sim-prefill-us-per-token=20000",
        "--worker-arg=--sim-decode-step-ms=10",
    )
    try:
        admin = redis.Redis.from_url(system.redis_url)
        log = asyncio.run(FaultRun(config, system.v1, admin, system.pids_of).run())
        stuck = stuck_tasks(admin)
    finally:
        leftovers = stop_system(system)
        (tmp_path / "up.log").write_text("".join(system.output))
    where = f"  the output of splitbus up: {tmp_path / 'up.log'}"
    report = "\n".join([summary(config, log), traces(log, system.output), stuck, notable(system.output), where])
    print(report, flush=True)
    assert log.injected >= config.faults // 2, report  # the run did what it is for
    assert len(log.outcomes) >= 50, report
    assert [o for o in log.outcomes if not o.exact] == [] and log.problems == [], report
    assert leftovers == [], report
