"""The discrete-event simulation behind ``splitbus bench stagger``, on hand-made traces."""

from __future__ import annotations

import pytest

from splitbus.bench import stagger_sim
from splitbus.bench.stagger_sim import GroupFull, GroupSimulation, TraceRequest, poisson_trace


@pytest.mark.parametrize("staggered", [False, True])
def test_one_request_leaves_the_other_ranks_idle(staggered: bool) -> None:
    result = GroupSimulation(4, staggered=staggered).run([TraceRequest(0.0, 100, 10)])
    # Every step (1 prefill + 9 decodes) has one working rank and three idle forwards.
    assert result.idle_forward_ratio == pytest.approx(0.75)
    assert result.idle_time_ratio == pytest.approx(0.75)
    assert 0 < result.step_utilization <= 0.25


def test_time_shares_add_up_to_at_most_one() -> None:
    trace = poisson_trace(80.0, 2.0, seed=3)
    for staggered in (False, True):
        result = GroupSimulation(8, staggered=staggered, seed=3).run(trace)
        assert result.requests == len(trace)
        assert result.idle_time_ratio + result.step_utilization <= 1.0 + 1e-9


def test_a_request_that_fits_nowhere_is_an_error_not_a_drop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stagger_sim, "KV_BLOCKS_PER_RANK", 4)
    with pytest.raises(GroupFull, match="no rank has KV room"):
        GroupSimulation(2, staggered=False).run([TraceRequest(0.0, 1000, 10)])
