"""``splitbus.bench.decisions``: a scheduler's own work on one request, stage by stage (no I/O)."""

from __future__ import annotations

from splitbus.bench.decisions import STAGES, measure_stages


def test_every_stage_of_a_request_is_timed_in_order() -> None:
    stages = measure_stages(count=8, requests=20, seed=0)
    assert list(stages) == list(STAGES) == ["decode", "place", "tasks", "arguments", "pack"]
    assert all(us > 0 for us in stages.values()), stages
