"""Traces across the hops (docs/metrics.md, "Spans"): OpenTelemetry spans from every process,
joined into one trace by the W3C ``traceparent`` each hop carries (the request entry, the task,
the KV frame's meta).

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (and
``OTEL_SDK_DISABLED`` is not ``true``): then opentelemetry is never imported and every helper
returns on its first line, so an untraced deployment pays one attribute read per hop; hot paths
guard with ``if tracing.on:``. On: a ``TracerProvider`` named ``splitbus-<part>`` sends its spans
in batches over OTLP/HTTP (the SDK reads the exporter's ``OTEL_*`` variables itself).

Spans are started with an explicit parent (a ``traceparent`` string) and ended by hand, never
made current: a request's hops run in different tasks and processes, and a parent passed by
value is the same in each. Spans carry ids, roles, token counts and outcomes only: never a
prompt, a completion or a key (docs/security.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from splitbus.bus.messages._check import is_traceparent

log = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")

on = False
"""Whether this process traces: read it (``tracing.on``) before building a span's attributes."""
_tracer: Any = None
_provider: Any = None

Span = Any
"""An OpenTelemetry span, or None with tracing off: typed loosely so callers never import
opentelemetry."""


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for traces: an OTLP endpoint set, the SDK not disabled."""
    environ = os.environ if environ is None else environ
    disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    return not disabled and any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def setup(part: str, attributes: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Start tracing for this process (``part``: api, scheduler, worker, ...) when ``wanted``;
    whether it is on. Asked for but not installed (the ``otel`` extra): one warning, off."""
    if not wanted(environ):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        log.warning("tracing: an OTLP endpoint is set but opentelemetry is not installed (%s); tracing off", exc)
        return False
    provider = _provider_for(part, attributes or {})
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    install(provider)
    return True


def _provider_for(part: str, attributes: Mapping[str, str]) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    return TracerProvider(resource=Resource.create({"service.name": f"splitbus-{part}", **attributes}))


def install(provider: Any) -> None:
    """Trace through ``provider`` (an SDK ``TracerProvider``; tests give one with an in-memory exporter)."""
    global on, _tracer, _provider
    _provider, _tracer, on = provider, provider.get_tracer("splitbus"), True


def shutdown() -> None:
    """Flush the spans not yet sent and stop tracing (each part's close)."""
    global on, _tracer, _provider
    provider, _provider, _tracer, on = _provider, None, None, False
    if provider is not None:
        provider.shutdown()


@contextmanager
def process(part: str, attributes: Mapping[str, str] | None = None) -> Iterator[None]:
    """``setup`` for the block (a process's life: its command's run), ``shutdown`` after it."""
    setup(part, attributes)
    try:
        yield
    finally:
        shutdown()


def client_parent(header: str | None) -> str:
    """The parent a client's ``traceparent`` header names, or ``""`` (a new root): a header that
    is not exactly a W3C traceparent is ignored, never refused (W3C's rule)."""
    return header if header is not None and is_traceparent(header) else ""


def start(
    name: str,
    parent: str = "",
    start_ns: int | None = None,
    attributes: Mapping[str, Any] | None = None,
    server: bool = False,
) -> Span:
    """A span named ``name``, child of the ``traceparent`` ``parent`` (a root if empty), started
    now or at ``start_ns`` (ns since the epoch); None with tracing off. End it with ``end``."""
    if not on:
        return None
    from opentelemetry.trace import SpanKind

    kind = SpanKind.SERVER if server else SpanKind.INTERNAL
    return _tracer.start_span(name, context=_context(parent), kind=kind, start_time=start_ns, attributes=attributes)


def end(span: Span, error: str = "", end_ns: int | None = None, attributes: Mapping[str, Any] | None = None) -> None:
    """End ``span`` (now, or at ``end_ns``) with these attributes; ``error`` marks it failed with
    that reason (a code or an exception's type, never a message)."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


@contextmanager
def span(name: str, parent: str = "", attributes: Mapping[str, Any] | None = None) -> Iterator[Span]:
    """``start`` .. ``end`` around a block; an exception marks the span failed by its type."""
    started = start(name, parent, attributes=attributes)
    try:
        yield started
    except BaseException as exc:
        end(started, type(exc).__name__)
        raise
    end(started)


def traceparent(span: Span) -> str:
    """The ``traceparent`` that makes ``span`` the parent of the next hop's spans; ``""`` for None."""
    if span is None:
        return ""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def _context(parent: str) -> Any:
    if not parent:
        return None
    # W3C's propagator itself, whatever OTEL_PROPAGATORS says: the bus carries traceparent only.
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": parent})
