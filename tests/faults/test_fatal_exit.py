"""A part that stops on a fatal error (a bug in a loop, not an entry: here, its own stream key
replaced by a string, so every read fails with WRONGTYPE, which no retry can fix) exits non-zero
and says why, so a supervisor restarts it. The worker used to exit 0 on this path."""

from __future__ import annotations

import pytest

from tests.faults.conftest import Bus


@pytest.mark.timeout(120)
def test_worker_exits_non_zero_on_a_fatal_error(bus: Bus) -> None:
    worker = bus.worker("w-fatal")
    bus.r.delete(bus.keys.tasks("w-fatal"))
    bus.r.set(bus.keys.tasks("w-fatal"), "not a stream")
    assert worker.wait() == 1, worker.log()
    assert "failed; stopping the worker" in worker.log() and "WRONGTYPE" in worker.log()


@pytest.mark.timeout(120)
def test_scheduler_exits_non_zero_on_a_fatal_error(bus: Bus) -> None:
    scheduler = bus.scheduler()
    bus.r.delete(bus.keys.requests)
    bus.r.set(bus.keys.requests, "not a stream")
    assert scheduler.wait() == 1, scheduler.log()
    assert "failed; stopping the scheduler" in scheduler.log() and "WRONGTYPE" in scheduler.log()
