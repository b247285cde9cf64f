"""bench serve's hops read off one request's spans (splitbus/bench/spans.py): pure arithmetic
on hand-made spans; tests/e2e/test_traces.py reads them off a real trace."""

from __future__ import annotations

import pytest

from splitbus.bench.http_client import HOPS
from splitbus.bench.spans import MissingSpan, SpanTimes, hops_from_spans

MS = 1_000_000


def _trace(*, scheduled: bool = True) -> list[SpanTimes]:
    spans = [
        SpanTimes("api.request", 0, 40 * MS),
        SpanTimes("api.admission", 1 * MS, 2 * MS),
        SpanTimes("worker.task_wait", 5 * MS, 6 * MS),  # D's
        SpanTimes("worker.task_wait", 4 * MS, 6 * MS),  # P's: the task XADD is the earliest
        SpanTimes("worker.prefill", 7 * MS, 12 * MS),
        SpanTimes("api.stream_back", 15 * MS, 40 * MS),
    ]
    return [*spans, SpanTimes("scheduler.wait", 3 * MS, 3 * MS + 500_000)] if scheduled else spans


def test_the_hops_are_the_spans_boundaries_in_order() -> None:
    hops = hops_from_spans(_trace())
    assert list(hops) == list(HOPS)
    assert list(hops.values()) == [3.0, 1.0, 8.0, 3.0, 15.0]
    assert sum(list(hops.values())[:-1]) == hops["TTFT"]


def test_a_request_the_api_placed_itself_has_no_scheduler_hop() -> None:
    hops = hops_from_spans(_trace(scheduled=False))
    assert hops["request XADD -> task XADD"] == 0
    assert hops["client send -> request XADD"] == 4.0


def test_a_trace_without_its_prefill_says_so() -> None:
    with pytest.raises(MissingSpan, match="worker.prefill"):
        hops_from_spans([s for s in _trace() if s.name != "worker.prefill"])
