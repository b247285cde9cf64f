"""``bench serve``'s hop breakdown (``splitbus.bench.http_client.HOPS``) read off one request's trace
(docs/metrics.md, "Spans") instead of its entries' ``ts``: the same hops, from a live system's
traces, with no probe requests.

Each hop starts where the one before ends: the request's ``api.request`` starts (the route, not
the client's send), its request entry's ``XADD`` (``scheduler.wait`` starts at the entry's
``ts``), its first task entry's ``XADD`` (the earliest ``worker.task_wait``), its first token (the
end of ``worker.prefill``, just before the token's ``XADD``), the API reading it
(``api.stream_back`` starts). A request the API dispatched itself (``--dispatch api``) has no
``scheduler.wait``: its first hop ends at its task's ``XADD`` and the scheduler's hop is 0, as
in ``bench serve``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from splitbus.bench.http_client import HOPS


@dataclass(frozen=True)
class SpanTimes:
    """What a hop needs of one span: its name, start and end (ns since the epoch)."""

    name: str
    start_ns: int
    end_ns: int


class MissingSpan(ValueError):
    """The trace lacks a span a hop is read from (not exported yet, or a request that failed)."""


def hops_from_spans(spans: Iterable[SpanTimes]) -> dict[str, float]:
    """One request's hops in ms, keyed by ``HOPS``' names (the last, TTFT, is their sum)."""
    listed = list(spans)
    request = _first(listed, "api.request").start_ns
    task = _first(listed, "worker.task_wait").start_ns
    waits = [s for s in listed if s.name == "scheduler.wait"]
    entry = min(s.start_ns for s in waits) if waits else task
    token = _first(listed, "worker.prefill").end_ns
    back = _first(listed, "api.stream_back").start_ns
    bounds = (request, entry, task, token, back)
    steps = [(after - before) / 1e6 for before, after in zip(bounds, bounds[1:], strict=False)]
    return dict(zip(HOPS, [*steps, (back - request) / 1e6], strict=True))


def _first(spans: list[SpanTimes], name: str) -> SpanTimes:
    """The earliest span of ``name`` (a moved request has more than one of some)."""
    found = [s for s in spans if s.name == name]
    if not found:
        raise MissingSpan(f"no {name} span in the trace")
    return min(found, key=lambda s: s.start_ns)
