"""A worker's spans (docs/metrics.md, "Spans"), children of the task's ``traceparent`` (the span
that placed it): ``worker.task_wait``, from the task entry's ``ts`` to the worker taking it; on a
prefill or mixed worker ``worker.prefill_queue`` (taken to prefill), ``worker.prefill`` (the
engine call of its batch) and, on P, ``worker.kv_transfer`` (the export and send of its KV, whose
``traceparent`` the frame's meta carries); on a decode worker ``worker.kv_wait`` (taken to the
frame's arrival) and ``worker.kv_import`` (a child of P's transfer span); ``worker.decode``, its
first decode step to its last (one span a request, never one a token).

A request's open spans live on its ``Sequence`` (``trace``); when it leaves the worker
(``left``: finished, cancelled, moved, failed, handed off) the ones still open end there, with
the outcome ``ended`` unless it finished (a prefill that raised ends failed, by the error's type,
and the request waits in ``worker.prefill_queue`` again). The shell
calls these only ``if tracing.on:``; a request whose task carries no ``traceparent`` (its API
does not trace) has none here either: a worker starts no trace of its own."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from splitbus import tracing
from splitbus.bus.core.streams import Delivery
from splitbus.bus.messages import Task
from splitbus.bus.messages._check import is_traceparent
from splitbus.bus.roles import Phase
from splitbus.worker.sequence import SeqSpans, Sequence


class Table(Protocol):
    """What spans read of the worker's ``RequestTable`` (a protocol: the table's module sits below
    the steps that call here, and importing it would lengthen the worker's import chain)."""

    def get(self, request_id: str) -> Sequence | None: ...

    def holds(self, seq: Sequence, *statuses: Any) -> bool: ...


def _ids(seq: Sequence) -> dict[str, Any]:
    return {"splitbus.request_id": seq.request_id, "splitbus.phase": seq.task.phase}


def taken(table: Table, delivery: Delivery) -> None:
    """The task of ``delivery`` was taken: its wait since its XADD, and the stage it waits in now."""
    task = delivery.message
    seq = table.get(task.request.request_id) if tracing.on and isinstance(task, Task) else None
    if seq is None or seq.task is not task or not _parent(task):
        return  # not taken (acked as a duplicate, refused, failed at once), or not traced
    parent, now = _parent(task), time.time_ns()
    start_ns = tracing.wait_start(delivery.published_us, now)
    if start_ns is not None:
        tracing.end(tracing.start("worker.task_wait", parent, start_ns, _ids(seq)), end_ns=now)
    stage = "worker.kv_wait" if task.phase == Phase.DECODE else "worker.prefill_queue"
    seq.trace = SeqSpans(parent, tracing.start(stage, parent, now, _ids(seq)))


def _parent(task: Task) -> str:
    """The span that placed the task, else the request's (a task written before traceparents)."""
    return task.traceparent or task.request.traceparent


def _next_step(seq: Sequence, name: str, parent: str = "", attributes: Mapping[str, Any] | None = None) -> None:
    """End the request's open stage and start ``name`` (a child of ``parent``, else of its task's span)."""
    spans = seq.trace
    if spans is not None:
        tracing.end(spans.step)
        spans.step = tracing.start(name, parent or spans.parent, attributes={**_ids(seq), **(attributes or {})})


def _end_step(seq: Sequence, error: str = "", attributes: Mapping[str, Any] | None = None) -> None:
    spans = seq.trace
    if spans is not None:
        tracing.end(spans.step, error, attributes=attributes)
        spans.step = None


def prefill_started(batch: list[Sequence]) -> None:
    for seq in batch:
        sizes = {"splitbus.batch_size": len(batch), "splitbus.prompt_tokens": seq.prompt_len}
        _next_step(seq, "worker.prefill", attributes=sizes)


def prefill_ended(batch: list[Sequence]) -> None:
    for seq in batch:
        _end_step(seq, attributes={"splitbus.cached_tokens": seq.prompt_cached})


def prefill_failed(batch: list[Sequence], exc: BaseException) -> None:
    """The prefill raised and its batch is queued again: ``worker.prefill`` ends failed (the next
    turn's would otherwise end it as a success), ``worker.prefill_queue`` starts again."""
    for seq in batch:
        _end_step(seq, type(exc).__name__)
        _next_step(seq, "worker.prefill_queue")


@contextlib.contextmanager
def kv_transfer(seq: Sequence, meta: dict[str, Any]) -> Iterator[None]:
    """P's ``worker.kv_transfer`` around the export and send; the frame's ``meta`` carries its
    ``traceparent`` (signed with the rest of the meta)."""
    spans = seq.trace
    if spans is None:
        yield
        return
    span = tracing.start("worker.kv_transfer", spans.parent, attributes=_ids(seq))
    meta["traceparent"] = tracing.traceparent(span)
    try:
        yield
    except BaseException as exc:
        tracing.end(span, type(exc).__name__)
        raise
    tracing.end(span)


def import_started(seq: Sequence, meta: Mapping[str, Any]) -> None:
    """D's frame is in: the kv wait ends, the import starts (a child of P's transfer span; of the
    task's span when the frame carries none)."""
    parent = meta.get("traceparent", "")
    _next_step(seq, "worker.kv_import", parent if is_traceparent(parent) else "")


def import_ended(seq: Sequence, refusal: str | None) -> None:
    _end_step(seq, "refused" if refusal else "")


def decoding(batch: list[Sequence]) -> None:
    """Before a decode step: ``worker.decode`` starts for a request's first one."""
    for seq in batch:
        spans = seq.trace
        if spans is not None and spans.decode is None:
            spans.decode = tracing.start("worker.decode", spans.parent, attributes=_ids(seq))


def decoded(batch: list[Sequence], table: Table) -> None:
    """After a decode step: ``worker.decode`` ends for the requests that finished (or left)."""
    for seq in batch:
        if _left(seq, table):
            _end_decode(seq)


def left(seq: Sequence) -> None:
    """``seq`` left the worker (``Left``): whatever of its spans is still open ends now."""
    _end_step(seq, attributes={"splitbus.outcome": "ended"})
    _end_decode(seq)


def _end_decode(seq: Sequence) -> None:
    spans = seq.trace
    if spans is not None and spans.decode is not None:
        ended = {"splitbus.output_tokens": len(seq.output_ids), "splitbus.outcome": seq.finish_reason or "ended"}
        tracing.end(spans.decode, attributes=ended)
        spans.decode = None


def _left(seq: Sequence, table: Table) -> bool:
    """Whether ``seq`` decodes no more here: finished, or out of the table (failed, moved, cancelled)."""
    return seq.finished or not table.holds(seq)
