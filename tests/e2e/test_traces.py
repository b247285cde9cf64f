"""Traces across the hops: one request through ``splitbus up`` with a prefill and a decode worker,
every process exporting over OTLP/HTTP to a loopback receiver (tests/e2e/otlp.py), makes one
trace: the client's, connected from the API through the scheduler to P and D."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from splitbus.bench.http_client import HOPS
from splitbus.bench.spans import SpanTimes, hops_from_spans
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import System, start_system, stop_system
from tests.e2e.otlp import OtlpReceiver, ReceivedSpan

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
WHERE = {
    "api.request": ("splitbus-api", ""),
    "api.admission": ("splitbus-api", ""),
    "api.request_entry": ("splitbus-api", ""),
    "api.stream_back": ("splitbus-api", ""),
    "scheduler.wait": ("splitbus-scheduler", ""),
    "scheduler.place": ("splitbus-scheduler", ""),
    "worker.prefill_queue": ("splitbus-worker", "prefill"),
    "worker.prefill": ("splitbus-worker", "prefill"),
    "worker.kv_transfer": ("splitbus-worker", "prefill"),
    "worker.kv_wait": ("splitbus-worker", "decode"),
    "worker.kv_import": ("splitbus-worker", "decode"),
    "worker.decode": ("splitbus-worker", "decode"),
}
"""Each span of the request, and the process (service, worker role) it comes from."""


@pytest.mark.parametrize("at_exit", [False, True], ids=["batched", "flushed-at-exit"])
def test_one_request_through_up_is_one_trace_across_every_process(tmp_path: Path, at_exit: bool) -> None:
    """Sent in batches as they end; and, with a batch delay longer than the test (60 s), sent
    only by each process's flush as it stops: nothing before ``stop_system``, everything after."""
    with OtlpReceiver() as receiver:
        delay = "60000" if at_exit else "100"
        environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": delay}
        system = start_system(tmp_path, "--prefill", "1", "--decode", "1", environ=environ)
        try:
            _complete(system)
            if not at_exit:
                spans = receiver.wait_for({*WHERE, "worker.task_wait"}, CLIENT_TRACE, timeout_s=30)
            else:
                assert receiver.spans == []  # one request's spans are far fewer than a batch
        finally:
            assert stop_system(system) == []
        if at_exit:  # every process has exited: its flush is done
            spans = receiver.wait_for({*WHERE, "worker.task_wait"}, CLIENT_TRACE, timeout_s=0)
        everything = list(receiver.spans)
    _check_connected(spans, everything)


def _complete(system: System) -> None:
    client = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0, timeout=60)
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    completion = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=6, seed=3, extra_headers={"traceparent": traceparent}
    )
    assert completion.choices[0].text == sim_text(3, 6)


def _check_connected(spans: list[ReceivedSpan], everything: list[ReceivedSpan]) -> None:
    names = {s.name for s in spans}
    assert set(WHERE) <= names, f"missing: {set(WHERE) - names}"
    assert {s.trace_id for s in everything} == {CLIENT_TRACE}  # nothing of the request outside its trace
    _check_tree(spans)
    _check_processes(spans)
    _check_hand_off(spans)
    hops = hops_from_spans(SpanTimes(s.name, s.start_ns, s.end_ns) for s in spans)
    assert list(hops) == list(HOPS)  # bench serve's breakdown, read off the trace
    assert min(hops.values()) >= 0, hops  # one machine, one clock: in order


def _named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def _check_tree(spans: list[ReceivedSpan]) -> None:
    """The root's parent is the client's span; every other span's parent is one of the trace's."""
    (root,) = _named(spans, "api.request")
    assert root.parent_span_id == CLIENT_SPAN
    ids = {s.span_id for s in spans}
    orphans = [(s.name, s.parent_span_id) for s in spans if s is not root and s.parent_span_id not in ids]
    assert orphans == []


def _check_processes(spans: list[ReceivedSpan]) -> None:
    """Each span from its process; a task_wait from each worker."""
    elsewhere = [s for s in spans if WHERE.get(s.name, (s.service, s.role)) != (s.service, s.role)]
    assert elsewhere == []
    assert all(s.end_ns >= s.start_ns > 0 for s in spans)
    assert {s.role for s in _named(spans, "worker.task_wait")} == {"prefill", "decode"}


def _check_hand_off(spans: list[ReceivedSpan]) -> None:
    (decode,) = _named(spans, "worker.decode")
    assert decode.attributes["splitbus.output_tokens"] == 6  # one span for the whole decode
    (transfer,) = _named(spans, "worker.kv_transfer")
    (imported,) = _named(spans, "worker.kv_import")
    assert imported.parent_span_id == transfer.span_id  # the frame's meta carried P's span across
