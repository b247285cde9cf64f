"""Traces across the hops (docs/metrics.md, "Spans"): OpenTelemetry spans from every process,
joined into one trace by the W3C ``traceparent`` each hop carries (the request entry, the task,
the KV frame's meta).

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (and
``OTEL_SDK_DISABLED`` is not ``true``): then splitbus loads none of the tracing SDK, exporter or
propagator (redis-py imports OpenTelemetry's metrics modules when they are installed, for its own
observability) and every helper returns on its first line, so an untraced deployment pays one
attribute read per hop; hot paths guard with ``if tracing.on:``. On: a ``TracerProvider`` named
``splitbus-<part>`` sends its spans in batches over OTLP/HTTP to the endpoint (and with the
headers) of the environment ``setup`` was given; the SDK reads the exporter's other ``OTEL_*``
variables itself. ``shutdown`` flushes for at most ``FLUSH_S``: a collector that is down must
not hold a stopping process past its supervisor's stop.

Spans are started with an explicit parent (a ``traceparent`` string) and ended by hand, never
made current: a request's hops run in different tasks and processes, and a parent passed by
value is the same in each. Spans carry ids, roles, token counts and outcomes only: never a
prompt, a completion or a key (docs/security.md).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from splitbus.bus.messages._check import is_traceparent

log = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
HEADER_VARIABLES = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS")
"""Each pair: the general variable, then the traces' own, which wins (the OTLP exporter's rule)."""
TRACES_PATH = "/v1/traces"
"""What OTLP/HTTP appends to the general endpoint (the traces' own endpoint is taken whole)."""
MAX_WAIT_NS = 3600 * 10**9
"""The longest wait a span is made for (``wait_start``): an hour, longer than any request waits."""
FLUSH_S = 2.0
"""How long ``shutdown`` waits for the last spans to be sent: an exporter retries a refused or
silent collector for longer (6.8 s measured against a closed port), and ``splitbus up`` gives each
child 10 s to stop, its drain included."""

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
    """Start tracing for this process (``part``: api, scheduler, worker, ...) when ``environ``
    (``os.environ`` if None) ``wanted`` it, exporting to its endpoint with its headers; whether
    it is on. Asked for but not installed (the ``otel`` extra): one warning, off."""
    environ = os.environ if environ is None else environ
    if not wanted(environ):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.util.re import parse_env_headers
    except ImportError as exc:
        log.warning("tracing: an OTLP endpoint is set but opentelemetry is not installed (%s); tracing off", exc)
        return False
    headers = parse_env_headers(_last_set(environ, HEADER_VARIABLES), liberal=True)
    exporter = OTLPSpanExporter(endpoint=traces_endpoint(environ), headers=headers or None)
    provider = _provider_for(part, attributes or {})
    provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    return True


def traces_endpoint(environ: Mapping[str, str]) -> str:
    """Where the spans go: the traces' own endpoint as given, else the general one's ``/v1/traces``."""
    general, own = (environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)
    return own or general.removesuffix("/") + TRACES_PATH


def _last_set(environ: Mapping[str, str], names: tuple[str, ...]) -> str:
    """The value of the last of ``names`` that is set (the more specific variable), or ``""``."""
    return next((environ[name] for name in reversed(names) if environ.get(name, "").strip()), "")


def _provider_for(part: str, attributes: Mapping[str, str]) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    # No flush of the SDK's own at exit: ``shutdown``'s is bounded, the SDK's is not.
    resource = Resource.create({"service.name": f"splitbus-{part}", **attributes})
    return TracerProvider(resource=resource, shutdown_on_exit=False)


def install(provider: Any) -> None:
    """Trace through ``provider`` (an SDK ``TracerProvider``; tests give one with an in-memory exporter)."""
    global on, _tracer, _provider
    _provider, _tracer, on = provider, provider.get_tracer("splitbus"), True


def shutdown(flush_s: float = FLUSH_S) -> None:
    """Flush the spans not yet sent and stop tracing (each part's close), waiting at most
    ``flush_s``: past it the flush goes on in a daemon thread, and whatever it has not sent when
    the process exits is lost (said once)."""
    global on, _tracer, _provider
    provider, _provider, _tracer, on = _provider, None, None, False
    if provider is None:
        return
    flushing = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
    flushing.start()
    flushing.join(flush_s)
    if flushing.is_alive():
        log.warning("tracing: the last spans were not sent within %.1f s (is the collector up?); left unsent", flush_s)


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


def wait_start(published_us: int | None, now_ns: int) -> int | None:
    """When a wait that began at an entry's ``ts`` (µs since the epoch, its writer's clock) starts,
    in ns, or None: no wait span. A ``ts`` that is no time (0 or less) or older than ``MAX_WAIT_NS``
    is a forged or broken entry: a span started there would be refused by the OTLP encoder, and
    with it the whole batch of spans, other requests' too. One ahead of ``now_ns`` starts now (the
    writer's clock may run ahead of this one)."""
    if published_us is None or published_us <= 0 or now_ns - published_us * 1000 > MAX_WAIT_NS:
        return None
    return min(published_us * 1000, now_ns)


def traceparent(span: Span) -> str:
    """The ``traceparent`` that makes ``span`` the parent of the next hop's spans; ``""`` for None."""
    if span is None:
        return ""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def _context(parent: str) -> Any:
    if not parent:
        # An empty context, not None: None would make whatever span is current the parent.
        from opentelemetry.context import Context

        return Context()
    # W3C's propagator itself, whatever OTEL_PROPAGATORS says: the bus carries traceparent only.
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": parent})
