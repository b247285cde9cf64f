"""Traces across the hops, in one process (splitbus/tracing.py and each part's spans module),
with the SDK's in-memory exporter: the client's header, the ``traceparent`` each bus entry carries
through the codec, and the spans each hop makes of it. tests/e2e/test_traces.py follows one
request through every process of ``splitbus up``."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from starlette.types import Message, Scope

from splitbus import tracing
from splitbus.api import spans as api_spans
from splitbus.api.app import EXCEPTION_HANDLERS
from splitbus.api.errors import TooManyRequests
from splitbus.bus.core import codec
from splitbus.bus.core.streams import Delivery
from splitbus.bus.dispatch import DispatchOutcome
from splitbus.bus.messages import GenerateRequest, SamplingParams, Task
from splitbus.scheduler import spans as scheduler_spans
from splitbus.worker import spans as worker_spans
from splitbus.worker.sequence import Sequence
from splitbus.worker.table import RequestTable, Status
from tests import traced
from tests.e2e.otlp import OtlpReceiver
from tests.traced import CLIENT, CLIENT_SPAN, CLIENT_TRACE
from tests.traced import named as _named


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    """Tracing on, into memory, for one test."""
    with traced.in_memory() as exporter:
        yield exporter


def _parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


@pytest.mark.parametrize(
    ("environ", "wanted"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "false"}, True),
    ],
)
def test_tracing_is_on_only_with_an_endpoint_and_not_disabled(environ: dict[str, str], wanted: bool) -> None:
    assert tracing.wanted(environ) is wanted


def test_setup_without_an_endpoint_leaves_tracing_off() -> None:
    assert tracing.setup("api", environ={}) is False
    assert tracing.on is False
    assert tracing.start("api.request") is None
    assert tracing.traceparent(None) == ""


def test_setup_names_the_service_by_its_part() -> None:
    assert tracing.setup("worker", {"splitbus.role": "decode"}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    try:
        assert tracing.on is True
        resource = tracing._provider.resource.attributes
        assert (resource["service.name"], resource["splitbus.role"]) == ("splitbus-worker", "decode")
    finally:
        tracing.shutdown()
    assert tracing.on is False


def test_setup_exports_to_the_endpoint_and_with_the_headers_of_the_environment_it_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)  # only the environment given says where
    with OtlpReceiver() as receiver:
        environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint + "/", "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=t1"}
        assert tracing.setup("scheduler", environ=environ)
        tracing.end(tracing.start("scheduler.place"))
        tracing.shutdown()
        assert [(s.service, s.name) for s in receiver.spans] == [("splitbus-scheduler", "scheduler.place")]
        assert receiver.headers[0]["x-tenant"] == "t1"


@pytest.mark.parametrize(
    ("environ", "endpoint"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "http://c:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": " http://c:4318/ "}, "http://c:4318/v1/traces"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"},
            "http://t/x",
        ),
    ],
)
def test_the_traces_endpoint_is_the_traces_own_else_the_generals_path(environ: dict[str, str], endpoint: str) -> None:
    assert tracing.traces_endpoint(environ) == endpoint


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_shutdown_gives_up_on_a_collector_that_refuses_within_its_bound() -> None:
    # Unbounded, the exporter's retries held this for 6.8 s, past what ``up`` gives a child to stop.
    assert tracing.setup("worker", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"})
    tracing.end(tracing.start("worker.decode"))
    began = time.monotonic()
    tracing.shutdown()
    assert time.monotonic() - began < 5  # a correctness bound (FLUSH_S is 2 s), not a timing
    assert tracing.on is False


def test_a_new_root_has_no_parent_even_inside_a_current_span(exported: InMemorySpanExporter) -> None:
    current = tracing.start("other")
    with trace.use_span(current, end_on_exit=True):  # made current, as another library's span would be
        root = tracing.start("api.request", tracing.client_parent(None), server=True)
    tracing.end(root)
    assert _named(exported)["api.request"].parent is None


# -- the API's server span ----------------------------------------------------------------------


async def _answer(request: Request) -> Response:
    if request.query_params.get("fail"):
        raise TooManyRequests("no room")
    api_spans.enter(api_spans.of(request), "api.admission")
    api_spans.enter(api_spans.of(request), "")
    if request.query_params.get("stream"):
        api_spans.enter(api_spans.of(request), "api.stream_back")
        return StreamingResponse(iter([b"a", b"b"]), media_type="text/event-stream")
    trace = api_spans.of(request)
    return JSONResponse({"traceparent": "" if trace is None else trace.traceparent})


@pytest.fixture
def client() -> Iterator[TestClient]:
    routes = [Route("/v1/completions", api_spans.traced(_answer), methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def test_the_clients_traceparent_is_the_parent_of_the_request_span(
    exported: InMemorySpanExporter, client: TestClient
) -> None:
    carried = client.post("/v1/completions", headers={"traceparent": CLIENT}).json()["traceparent"]
    spans = _named(exported)
    request = spans["api.request"]
    assert request.kind is SpanKind.SERVER
    assert format(request.context.trace_id, "032x") == CLIENT_TRACE
    assert format(_parent_id(request) or 0, "016x") == CLIENT_SPAN
    assert carried == f"00-{CLIENT_TRACE}-{request.context.span_id:016x}-01"  # what the request entry carries
    assert _parent_id(spans["api.admission"]) == request.context.span_id
    assert request.attributes is not None and request.attributes["http.response.status_code"] == 200


@pytest.mark.parametrize(
    "header",
    [
        "garbage",
        CLIENT.upper(),
        f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
        f"00-{'0' * 32}-{CLIENT_SPAN}-01",
        f"00-{CLIENT_TRACE}-{'0' * 16}-01",
        CLIENT + "-extra",
        CLIENT + " ",
        "00-" + "a" * 300,
    ],
)
def test_a_bad_client_header_starts_a_new_trace_and_is_never_refused(
    exported: InMemorySpanExporter, client: TestClient, header: str
) -> None:
    response = client.post("/v1/completions", headers={"traceparent": header})
    assert response.status_code == 200
    request = _named(exported)["api.request"]
    assert request.parent is None
    assert format(request.context.trace_id, "032x") != CLIENT_TRACE
    assert response.json()["traceparent"].startswith(f"00-{request.context.trace_id:032x}-")


def test_a_streamed_answer_ends_its_spans_after_the_last_chunk(
    exported: InMemorySpanExporter, client: TestClient
) -> None:
    assert client.post("/v1/completions?stream=1").text == "ab"
    spans = _named(exported)
    assert {"api.request", "api.admission", "api.stream_back"} <= set(spans)
    assert spans["api.stream_back"].end_time is not None and spans["api.request"].end_time is not None
    assert spans["api.stream_back"].end_time <= spans["api.request"].end_time


def test_a_streamed_answer_whose_start_cannot_be_sent_still_ends_its_spans(exported: InMemorySpanExporter) -> None:
    """The client left before the response started: its body is never read, and the spans the
    body's end would close end with the send's error instead."""
    app = Starlette(routes=[Route("/v1/completions", api_spans.traced(_answer), methods=["POST"])])
    scope: Scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/v1/completions"}
    scope.update(query_string=b"stream=1", headers=[], scheme="http", server=("t", 80), root_path="")

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        raise OSError("the client is gone")  # as uvicorn's send raises once the client has gone

    with pytest.raises(ClientDisconnect):
        asyncio.run(app(scope, receive, send))
    spans = _named(exported)
    assert spans["api.request"].status.status_code is StatusCode.ERROR
    assert spans["api.request"].status.description == "ClientDisconnect"
    assert spans["api.stream_back"].status.status_code is StatusCode.ERROR


def test_a_refused_request_ends_its_span_as_an_error_with_its_status(
    exported: InMemorySpanExporter, client: TestClient
) -> None:
    assert client.post("/v1/completions?fail=1").status_code == 429
    request = _named(exported)["api.request"]
    assert request.status.status_code is StatusCode.ERROR
    assert request.attributes is not None and request.attributes["http.response.status_code"] == 429


def test_untraced_routes_run_unchanged(client: TestClient) -> None:
    assert tracing.on is False
    assert client.post("/v1/completions", headers={"traceparent": CLIENT}).json() == {"traceparent": ""}


# -- across the bus: request entry, task, KV frame -----------------------------------------------


class _Text:
    stopped = False

    def push(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


def _request(traceparent: str) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=4)
    return GenerateRequest("r1", "m", [1, 2, 3], sampling, "api-1", 10**13, traceparent=traceparent)


def _through_codec(message: Any) -> Any:
    return codec.decode(codec.encode(message))


def _taken(table: RequestTable, task: Task, status: Status, published_us: int) -> Sequence:
    seq = Sequence(task, "1-0", _Text())
    table.add(seq, status)
    worker_spans.taken(table, Delivery("tasks", "1-0", task, published_us))
    return seq


def test_one_request_makes_one_connected_trace_across_the_hops(exported: InMemorySpanExporter) -> None:
    """API -> request entry -> scheduler -> task entries -> P (prefill, KV frame) -> D (import,
    decode): every span in the client's trace, each parent one of them, each entry decoded."""
    root = tracing.start("api.request", tracing.client_parent(CLIENT), server=True)
    request = _through_codec(_request(tracing.traceparent(root)))
    published_us = (root.start_time or 0) // 1000
    placing = scheduler_spans.place(request, published_us)
    assert placing is not None
    prefill_task = _through_codec(Task("prefill", request, "d1", traceparent=placing.traceparent))
    decode_task = _through_codec(Task("decode", request, "p1", traceparent=placing.traceparent))
    scheduler_spans.placed(placing, DispatchOutcome.DISPATCHED)
    p_table, d_table = RequestTable(), RequestTable()
    p_seq = _taken(p_table, prefill_task, Status.QUEUED, published_us)
    d_seq = _taken(d_table, decode_task, Status.AWAITING_KV, published_us)
    worker_spans.prefill_started([p_seq])
    worker_spans.prefill_ended([p_seq])
    meta: dict[str, Any] = {"next_seq": 1}
    with worker_spans.kv_transfer(p_seq, meta):
        pass
    worker_spans.import_started(d_seq, meta)
    worker_spans.import_ended(d_seq, None)
    worker_spans.decoding([d_seq])
    d_seq.output_ids, d_seq.finish_reason = [5, 6, 7], "length"
    worker_spans.decoded([d_seq], d_table)
    tracing.end(root)
    spans = exported.get_finished_spans()
    names = sorted(s.name for s in spans)
    assert names == sorted(
        [
            "api.request",
            "scheduler.place",
            "scheduler.wait",
            "worker.task_wait",
            "worker.task_wait",
            "worker.prefill_queue",
            "worker.prefill",
            "worker.kv_transfer",
            "worker.kv_wait",
            "worker.kv_import",
            "worker.decode",
        ]
    )
    assert {format(s.context.trace_id, "032x") for s in spans} == {CLIENT_TRACE}
    ids = {s.context.span_id for s in spans}
    assert all(_parent_id(s) in ids for s in spans if s.name != "api.request")
    by_name = _named(exported)
    assert _parent_id(by_name["worker.kv_import"]) == by_name["worker.kv_transfer"].context.span_id
    assert _parent_id(by_name["worker.decode"]) == by_name["scheduler.place"].context.span_id
    assert by_name["scheduler.wait"].start_time == published_us * 1000
    assert by_name["worker.decode"].attributes == {
        "splitbus.request_id": "r1",
        "splitbus.phase": "decode",
        "splitbus.output_tokens": 3,
        "splitbus.outcome": "length",
    }


def test_a_dispatch_that_wrote_nothing_has_no_wait_span(exported: InMemorySpanExporter) -> None:
    placing = scheduler_spans.place(_request(CLIENT), 1)
    assert placing is not None
    scheduler_spans.placed(placing, DispatchOutcome.WORKER_GONE)
    (place,) = exported.get_finished_spans()
    assert place.name == "scheduler.place"
    assert place.attributes is not None and place.attributes["splitbus.outcome"] == "worker_gone"


@pytest.mark.parametrize("published_us", [-5, 0, 1, time.time_ns() // 1000 - 2 * 3600 * 10**6], ids=str)
def test_an_entry_whose_ts_is_no_time_makes_no_wait_span_and_the_batch_still_encodes(
    exported: InMemorySpanExporter, published_us: int
) -> None:
    """A forged or broken ``ts`` (no time, the epoch, two hours ago): a wait span from it would fail the
    OTLP encoder, and the whole export batch, other requests' spans too, with it."""
    request = _request(CLIENT)
    placing = scheduler_spans.place(request, published_us)
    scheduler_spans.placed(placing, DispatchOutcome.DISPATCHED)
    _taken(RequestTable(), Task("decode", request, "p1", traceparent=CLIENT), Status.AWAITING_KV, published_us)
    tracing.end(tracing.start("api.request", CLIENT))  # another span of the batch
    assert {s.name for s in exported.get_finished_spans()} == {"scheduler.place", "api.request"}
    assert traced.encodes(exported)


def test_an_entry_written_by_a_clock_ahead_waits_from_now(exported: InMemorySpanExporter) -> None:
    ahead_us = time.time_ns() // 1000 + 60 * 10**6
    scheduler_spans.placed(scheduler_spans.place(_request(CLIENT), ahead_us), DispatchOutcome.DISPATCHED)
    waited = _named(exported)["scheduler.wait"]
    assert waited.start_time == waited.end_time
    assert traced.encodes(exported)


def test_a_decode_that_goes_on_keeps_its_one_span_open(exported: InMemorySpanExporter) -> None:
    table = RequestTable()
    seq = _taken(table, Task("decode", _request(CLIENT), "p1"), Status.RUNNING, 1)
    for _ in range(3):
        worker_spans.decoding([seq])
        worker_spans.decoded([seq], table)
    assert "worker.decode" not in _named(exported)  # one span a request, never one a step
    table.remove(seq)  # cancelled, moved: it left
    worker_spans.decoded([seq], table)
    decode = _named(exported)["worker.decode"]
    assert decode.attributes is not None and decode.attributes["splitbus.outcome"] == "ended"


def test_a_frame_without_a_valid_traceparent_imports_under_its_task(exported: InMemorySpanExporter) -> None:
    table = RequestTable()
    seq = _taken(table, Task("decode", _request(CLIENT), "p1"), Status.AWAITING_KV, 1)
    worker_spans.import_started(seq, {"traceparent": "not-one"})
    worker_spans.import_ended(seq, "refused: bad frame")
    spans = _named(exported)
    assert _parent_id(spans["worker.kv_import"]) == int(CLIENT_SPAN, 16)
    assert spans["worker.kv_import"].status.status_code is StatusCode.ERROR
    assert spans["worker.kv_import"].status.description == "refused"  # a code: no frame text in a span


def test_a_request_from_an_untraced_api_starts_no_trace_downstream(exported: InMemorySpanExporter) -> None:
    request = _request("")
    assert scheduler_spans.place(request, 1) is None
    assert scheduler_spans.move(Task("prefill", request, "d1"), "p0") is None
    table = RequestTable()
    seq = _taken(table, Task("prefill", request, "d1"), Status.QUEUED, 1)
    assert seq.trace is None
    worker_spans.prefill_started([seq])
    meta: dict[str, Any] = {}
    with worker_spans.kv_transfer(seq, meta):
        pass
    assert meta == {}
    assert exported.get_finished_spans() == ()


# -- off: nothing of the SDK loaded ------------------------------------------------------------

_OFF = """
import sys
import splitbus.api.app, splitbus.worker.worker, splitbus.scheduler.scheduler, splitbus.cli.main
from splitbus import tracing
assert tracing.setup("api") is False and tracing.on is False
# redis-py imports the metrics API and SDK of opentelemetry when they are installed (its own
# observability); splitbus imports none of the tracing SDK, the exporter or the propagator.
loaded = [m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter",
          "opentelemetry.trace.propagation.tracecontext", "opentelemetry.propagate"))]
assert not loaded, loaded
"""

_NOT_INSTALLED = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, Blocked())
import splitbus.api.app, splitbus.worker.worker, splitbus.scheduler.scheduler
from splitbus import tracing
assert tracing.setup("api", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}) is False
assert tracing.on is False
"""


@pytest.mark.parametrize("script", [_OFF, _NOT_INSTALLED], ids=["off", "not-installed"])
def test_without_tracing_no_part_loads_the_tracing_sdk(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    if script is _NOT_INSTALLED:
        assert "opentelemetry is not installed" in done.stderr
