"""The scheduler's spans (docs/metrics.md, "Spans"), children of the request entry's
``traceparent`` (the API's ``api.request``): ``scheduler.wait``, from the entry's ``ts`` (its
XADD, the API's clock) to the dispatch that wrote its tasks, and ``scheduler.place``, that
dispatch (the script's write; each try of it a span, with its outcome, or failed by the error's
type when the write raised); the reaper's
``scheduler.move``, the write of a dead worker's task to new workers. The tasks written carry the
placing span's ``traceparent``: the parent of the workers' spans.

Callers guard with ``if tracing.on:``; with tracing off ``start`` returns None and the rest
returns at once."""

from __future__ import annotations

import time

from splitbus import tracing
from splitbus.bus.dispatch import DispatchOutcome
from splitbus.bus.messages import GenerateRequest, Task


class Placing:
    """One dispatch of a request entry: its ``scheduler.place`` span, and when it began."""

    def __init__(self, request: GenerateRequest, published_us: int | None) -> None:
        self.parent, self.published_us = request.traceparent, published_us
        self.started_ns = time.time_ns()
        ids = {"splitbus.request_id": request.request_id, "splitbus.model": request.model}
        self.span = tracing.start("scheduler.place", self.parent, attributes=ids)
        self.traceparent = tracing.traceparent(self.span)
        """What the tasks written carry."""

    def ended(self, outcome: DispatchOutcome) -> None:
        """The dispatch's outcome; once its tasks are written, the wait before it as well."""
        tracing.end(self.span, attributes={"splitbus.outcome": outcome.label})
        start_ns = tracing.wait_start(self.published_us, self.started_ns)
        if outcome is DispatchOutcome.DISPATCHED and start_ns is not None:
            waited = tracing.start("scheduler.wait", self.parent, start_ns)
            tracing.end(waited, end_ns=self.started_ns)

    def failed(self, exc: BaseException) -> None:
        """The dispatch raised (Redis refused, a bug): its span ends failed, by the error's type."""
        tracing.end(self.span, type(exc).__name__)


def place(request: GenerateRequest, published_us: int | None) -> Placing | None:
    """A ``Placing`` for a traced request in a traced process, else None (the scheduler starts no
    trace of its own: an entry without a ``traceparent`` came from an API that does not trace)."""
    return Placing(request, published_us) if tracing.on and request.traceparent else None


def placed(placing: Placing | None, outcome: DispatchOutcome) -> None:
    if placing is not None:
        placing.ended(outcome)


def not_placed(placing: Placing | None, exc: BaseException) -> None:
    if placing is not None:
        placing.failed(exc)


def move(task: Task, dead: str) -> tracing.Span:
    """The reaper's ``scheduler.move`` of ``task`` off ``dead``: a child of the task's placing span."""
    parent = task.traceparent or task.request.traceparent
    if not parent:
        return None
    attributes = {"splitbus.request_id": task.request.request_id, "splitbus.from_worker": dead}
    return tracing.start("scheduler.move", parent, attributes=attributes)


def moved(span: tracing.Span, outcome: DispatchOutcome) -> None:
    tracing.end(span, attributes={"splitbus.outcome": outcome.label})


def not_moved(span: tracing.Span, exc: BaseException) -> None:
    """The move's write raised: its span ends failed, by the error's type."""
    tracing.end(span, type(exc).__name__)
