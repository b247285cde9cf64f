"""Tracing on, into memory (splitbus/tracing.py with the SDK's in-memory exporter), for the
tests of each part's spans: ``with traced.in_memory() as exporter:`` in a test's fixture."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from splitbus import tracing

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
"""A client's ``traceparent``: the parent of a test's spans."""


@contextmanager
def in_memory() -> Iterator[InMemorySpanExporter]:
    """Tracing on for the block, each span in ``exporter.get_finished_spans()`` once it ends."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def named(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    """The finished spans by name (the last of a name that ended more than once)."""
    return {s.name: s for s in exporter.get_finished_spans()}


def encodes(exporter: InMemorySpanExporter) -> bool:
    """Whether the finished spans make one OTLP export request (what the exporter sends): the
    encoder refuses a time out of range, and with it the whole batch."""
    return encode_spans(exporter.get_finished_spans()).ByteSize() > 0
