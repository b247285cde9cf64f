"""Every error path over real HTTP: OpenAI's error JSON with the right status."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from splitbus.api.app import EXCEPTION_HANDLERS
from splitbus.api.errors import FAILURE_MESSAGES, INTERNAL_MESSAGE, from_failure
from splitbus.redis_server import EmbeddedRedis
from tests.api.conftest import CONTEXT, ApiProcess, start_api, stop_api
from tests.api.responder import Responder, failure_detail


def _post(api: ApiProcess, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(api.v1 + path, content=content, headers=headers, timeout=30, **kwargs)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        ([1, 2], None),
        ({"prompt": "x"}, "model"),
        ({"model": "tiny"}, "prompt"),
        ({"model": "tiny", "prompt": ""}, "prompt"),
        ({"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "tiny", "prompt": "x", "temperature": 5}, "temperature"),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "9"}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "n": 17}, "n"),
        ({"model": "tiny", "prompt": "x", "n": 0}, "n"),
        ({"model": "tiny", "prompt": "x", "best_of": 2}, "best_of"),
        ({"model": "tiny", "prompt": "x", "seed": 2**64}, "seed"),
        ({"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": "tiny", "prompt": "x", "logprobs": True}, "logprobs"),
        ({"model": "tiny", "prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"model": "tiny", "prompt": "x", "echo": 1}, "echo"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0, "echo": False}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "stop": 7}, "stop"),
        ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "tiny", "prompt": [1, 999999]}, "prompt"),
        ({"model": "tiny", "prompt": "x" * (CONTEXT + 1)}, "prompt"),
        ({"model": "tiny", "prompt": "x" * 10, "max_tokens": CONTEXT}, "max_tokens"),
    ],
)
def test_bad_completion_requests_get_400(api: ApiProcess, body: Any, param: str | None) -> None:
    error = _error(_post(api, "/completions", body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ],
)
def test_bad_chat_requests_get_400(api: ApiProcess, body: Any, param: str) -> None:
    assert _error(_post(api, "/chat/completions", body), 400)["param"] == param


def test_context_length_message_names_the_limit(api: ApiProcess) -> None:
    error = _error(_post(api, "/completions", {"model": "tiny", "prompt": "x" * 10, "max_tokens": CONTEXT}), 400)
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]


def test_too_many_top_logprobs_names_the_limit(api: ApiProcess) -> None:
    error = _error(_post(api, "/completions", {"model": "tiny", "prompt": "x", "logprobs": 21}), 400)
    assert error["message"] == "'logprobs' must be <= 20, got 21"


def test_unsupported_best_of_says_so(api: ApiProcess) -> None:
    error = _error(_post(api, "/completions", {"model": "tiny", "prompt": "x", "best_of": 2}), 400)
    assert "'best_of' = 2 is not supported" in error["message"]


def test_too_many_choices_names_the_limit(api: ApiProcess) -> None:
    error = _error(_post(api, "/completions", {"model": "tiny", "prompt": "x", "n": 17}), 400)
    assert error["message"] == "'n' must be <= 16, got 17"


def test_unknown_model_is_404(api: ApiProcess) -> None:
    error = _error(_post(api, "/completions", {"model": "gpt-9", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found"


def test_unknown_route_and_method_in_openai_shape(api: ApiProcess) -> None:
    _error(httpx.get(api.v1 + "/nothing"), 404)
    _error(httpx.get(api.v1 + "/completions"), 405)


def test_worker_error_before_any_token_keeps_its_status(api: ApiProcess) -> None:
    error = _error(_post(api, "/completions", {"model": "tiny", "prompt": "[fail:503]"}), 503)
    assert error["code"] == "scripted" and error["type"] == "service_unavailable_error"
    streamed = _post(api, "/completions", {"model": "tiny", "prompt": "[fail:500]", "stream": True})
    assert _error(streamed, 500)["code"] == "scripted"


@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_error_reaches_the_client_without_its_internal_detail(
    api: ApiProcess, responder: Responder, stream: bool
) -> None:
    # The responder's error entry names its worker (role-host-pid) and an exception, as a real
    # worker's does; the client reads a stable message, the code and the request id only.
    response = _post(api, "/chat/completions", {**_chat("[fail:500]"), "stream": stream})
    error = _error(response, 500)
    request_id = response.headers["x-request-id"]
    assert request_id == responder.served[-1]
    assert request_id in error["message"] and error["code"] == "scripted"
    for internal in (responder.worker_id, "RuntimeError", "CUDA", failure_detail(responder.worker_id)):
        assert internal not in response.text
    assert api.log is not None
    _until(lambda: f"request {request_id} failed" in api.log.read_text())  # type: ignore[union-attr]
    logged = next(line for line in api.log.read_text().splitlines() if request_id in line)
    assert failure_detail(responder.worker_id) in logged


def _chat(content: str) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}]}


def test_worker_429_reaches_the_client_as_429(api: ApiProcess) -> None:
    # Over HTTP what the unit test below checks in-process: before TooManyRequests took a code,
    # a worker's 429 raised TypeError in the API and its client got a 500.
    response = _post(api, "/completions", {"model": "tiny", "prompt": "[fail:429]"})
    error = _error(response, 429)
    assert error["type"] == "rate_limit_error" and error["code"] == "scripted"
    assert response.headers["retry-after"] == "1"


def test_request_past_its_deadline_is_504_and_cancelled(api: ApiProcess, responder: Responder) -> None:
    # The module's API runs with --request-timeout 5 (+2 s grace for the worker's own error).
    response = _post(api, "/completions", {"model": "tiny", "prompt": "[silent]"})
    error = _error(response, 504)
    assert error["type"] == "timeout_error"
    rid = responder.served[-1]
    _until(lambda: rid in responder.cancelled)


def test_a_requests_own_timeout_ends_its_wait_sooner(api: ApiProcess, responder: Responder) -> None:
    """Its ``timeout`` of 1 s, not the server's 5 s, is the relay's wait: the 504 says so."""
    response = _post(api, "/completions", {"model": "tiny", "prompt": "[silent]", "timeout": 1})
    error = _error(response, 504)
    assert error["type"] == "timeout_error" and error["message"].startswith("the request did not finish within 1s ")
    rid = responder.served[-1]
    _until(lambda: rid in responder.cancelled)


def test_body_over_the_limit_is_413(api: ApiProcess) -> None:
    big = json.dumps({"model": "tiny", "prompt": "x" * (5 * 1024 * 1024)})
    _error(_post(api, "/completions", big), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        for _ in range(6):
            yield b" " * (1024 * 1024)

    json_type = {"content-type": "application/json"}
    _error(httpx.post(api.v1 + "/completions", content=chunks(), headers=json_type, timeout=30), 413)


def test_model_without_live_worker_is_503(
    redis_server: EmbeddedRedis, tiny_model: Path, tmp_path: Path, prefix: str, responder: Responder
) -> None:
    lonely = tmp_path / "lonely"
    shutil.copytree(tiny_model, lonely)
    api = start_api(redis_server.url, prefix, [tiny_model, lonely])
    try:
        error = _error(_post(api, "/completions", {"model": "lonely", "prompt": "x"}), 503)
        assert "no live worker serves model 'lonely'" in error["message"]
    finally:
        stop_api(api)


def _until(check: Any, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.mark.parametrize("status", [400, 401, 404, 413, 429, 500, 503, 504, 599])
def test_every_status_a_worker_can_ask_for_becomes_its_error(status: int) -> None:
    # A Failed entry carries a status and a code; a 429 used to raise TypeError here
    # (TooManyRequests took no code), so its client got a 500 instead.
    error = from_failure(status, "the_code", "cmpl-1")
    assert error.code == "the_code" and error.status == (status if status != 599 else 500)
    assert error.message.endswith("(request id cmpl-1)")


@pytest.mark.parametrize(
    "code, expected",
    [
        ("out_of_kv_blocks", "out_of_kv_blocks"),
        ("handler_failed: ValueError: bad token 7 at prefill-gpu3-4242", "worker_error"),  # a dead letter's reason
        ("Worker-1", "worker_error"),
    ],
)
def test_a_failure_code_reaches_the_client_only_when_it_is_a_code(code: str, expected: str) -> None:
    error = from_failure(500, code, "cmpl-1")
    assert error.code == expected
    stable = FAILURE_MESSAGES.get(expected, INTERNAL_MESSAGE)
    assert error.message == f"{stable} (request id cmpl-1)"


def test_an_unexpected_exception_reaches_the_client_without_its_text(caplog: pytest.LogCaptureFixture) -> None:
    # The API's own handlers, on a route that fails as a bug would: its text names a worker.
    async def broken(request: Request) -> Response:
        raise RuntimeError("KeyError in the ledger of prefill-gpu3-4242")

    app = Starlette(routes=[Route("/v1/broken", broken)], exception_handlers=EXCEPTION_HANDLERS)
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/v1/broken")
    error = _error(response, 500)
    request_id = response.headers["x-request-id"]
    assert error["code"] == "internal_error" and request_id in error["message"]
    assert "prefill-gpu3-4242" not in response.text and "KeyError" not in response.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and "prefill-gpu3-4242" in str(logged[0].exc_info[1])  # type: ignore[index]
