"""Fuzz the API from its own /openapi.json (schemathesis): no 5xx, and it still serves a normal
request afterwards. Bounded: a few dozen cases per operation."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from splitbus.tokenization.byte_level import write_byte_level_tokenizer
from splitbus.worker.engines.sim import sim_text
from tests.e2e.conftest import start_system, stop_system

EXAMPLES = 25


@pytest.mark.timeout(300)
def test_fuzzing_finds_no_server_error(tmp_path: Path) -> None:
    model = tmp_path / "tiny"  # a short context keeps every generated request quick
    write_byte_level_tokenizer(model)
    (model / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 256})
    )
    system = start_system(
        tmp_path / "up",
        "--model",
        str(model),
        "--worker-arg=--sim-decode-step-ms",
        "--worker-arg=0.2",
        "--api-workers",  # one API process: its /metrics count every request the fuzzer sent
        "1",
    )
    try:
        schema = schemathesis.openapi.from_url(system.base_url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
        for operation in operations:
            _fuzz(operation, system.base_url)
        statuses = _statuses(system.base_url)
        assert statuses.get(("/v1/completions", "200"), 0) > 0 and statuses.get(("/v1/completions", "400"), 0) > 0, (
            statuses
        )
        # /ready answered 503 while `splitbus up` was starting (its probes): only /v1/* counts here.
        assert sum(n for (route, code), n in statuses.items() if route.startswith("/v1/") and code.startswith("5")) == 0
        reply = openai.OpenAI(base_url=system.v1, api_key="x", max_retries=0).completions.create(
            model="tiny", prompt="x", max_tokens=4, seed=3
        )
        assert reply.choices[0].text == sim_text(3, 4)
    finally:
        assert stop_system(system) == []


def _fuzz(operation: schemathesis.APIOperation, base_url: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def check(case: schemathesis.Case) -> None:
        _hold_timeout(case)
        response = case.call(base_url=base_url, timeout=60)
        assert response.status_code < 500, (operation.label, case.body, response.status_code, response.text[:300])

    check()


FUZZ_TIMEOUT_S = 60
"""The shortest request ``timeout`` a fuzzed case asks for."""


def _hold_timeout(case: schemathesis.Case) -> None:
    """A request's own ``timeout`` of microseconds is answered 504 at its deadline by design, not
    as a server error: a fuzzed one is held to at least ``FUZZ_TIMEOUT_S`` (larger ones, up to
    any size, still reach the server; tests/api/test_protocol.py checks the small and bad ones)."""
    timeout = case.body.get("timeout") if isinstance(case.body, dict) else None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        case.body["timeout"] = max(timeout, FUZZ_TIMEOUT_S)


def _statuses(base_url: str) -> dict[tuple[str, str], float]:
    """Requests by route and status, from the API's own metrics."""
    import re

    import httpx

    counts: dict[tuple[str, str], float] = {}
    for route, status, value in re.findall(
        r'splitbus_api_requests_total\{route="([^"]+)",status="(\d+)"\} ([\d.e+]+)',
        httpx.get(base_url + "/metrics").text,
    ):
        counts[(route, status)] = float(value)
    return counts
