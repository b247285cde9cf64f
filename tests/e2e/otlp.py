"""A loopback OTLP/HTTP trace receiver: what a collector is to ``splitbus up``'s processes, with
nothing outside the machine. It takes ``POST /v1/traces`` (protobuf, gzip or not), decodes each
body with opentelemetry-proto's ``ExportTraceServiceRequest`` and keeps the spans with the
``service.name`` of the process that sent them."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_BODY = 16 * 2**20


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    """The sending process's ``service.name`` (``splitbus-api``, ``splitbus-worker``, ...)."""
    role: str
    """Its ``splitbus.role`` resource attribute (a worker's), else ""."""
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    """"" for a root."""
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


class OtlpReceiver:
    """Use as a context manager; ``endpoint`` is what ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.headers: list[dict[str, str]] = []
        """Each export request's HTTP headers (names lower-cased)."""
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length", "0"))
                if self.path != "/v1/traces" or not 0 < length <= MAX_BODY:
                    self.send_error(404 if self.path != "/v1/traces" else 400)
                    return
                body = self.rfile.read(length)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(ExportTraceServiceRequest.FromString(body), self.headers.items())
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def take(self, request: ExportTraceServiceRequest, headers: Iterable[tuple[str, str]] = ()) -> None:
        with self.lock:
            self.headers.append({name.lower(): value for name, value in headers})
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope in resource_spans.scope_spans:
                with self.lock:
                    self.spans += [_span(resource, s) for s in scope.spans]

    def wait_for(self, names: set[str], trace_id: str, timeout_s: float) -> list[ReceivedSpan]:
        """The spans of ``trace_id`` once every name in ``names`` is among them (or the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                found = [s for s in self.spans if s.trace_id == trace_id]
            if names <= {s.name for s in found} or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


def _span(resource: dict[str, Any], span: Any) -> ReceivedSpan:
    return ReceivedSpan(
        resource.get("service.name", ""),
        resource.get("splitbus.role", ""),
        span.name,
        span.trace_id.hex(),
        span.span_id.hex(),
        span.parent_span_id.hex(),
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        _attributes(span.attributes),
    )


def _attributes(pairs: Any) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        kind = pair.value.WhichOneof("value")
        out[pair.key] = getattr(pair.value, kind) if kind else None
    return out
