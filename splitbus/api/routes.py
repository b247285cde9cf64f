"""Route handlers. Each parses, delegates, and returns; errors are raised as ApiError."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import anyio
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from splitbus.api import protocol, spans
from splitbus.api.choices import respond
from splitbus.api.errors import (
    BadRequest,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
    TooManyRequests,
    UnsupportedMediaType,
)
from splitbus.api.generate import ClientDisconnected
from splitbus.api.metrics import REFUSALS
from splitbus.api.openapi import openapi_spec
from splitbus.api.state import ApiState
from splitbus.bus.core import hopmarks
from splitbus.bus.core.connection import TRANSIENT_ERRORS

log = logging.getLogger(__name__)
JSON_MEDIA_TYPE = "application/json"
T = TypeVar("T")


async def read_json(request: Request) -> Any:
    """The body as JSON. Checked before it is read: its media type (415), its declared size
    (413), and a free read slot (429); while read: its size even without Content-Length (413),
    and a deadline (408)."""
    state: ApiState = request.state.api
    check_json_media_type(request.headers.get("content-type"))
    declared = _content_length(request)
    if declared is not None and declared > state.config.max_body_bytes:
        raise PayloadTooLarge(f"the request body is larger than {state.config.max_body_bytes} bytes")
    with (
        _refusal_counted(request, "body_reads", "with 429: too many bodies were being received"),
        state.bodies.slot(declared),
    ):
        try:
            with anyio.fail_after(state.config.body_timeout_s):
                body = await _read_body(request, state.config.max_body_bytes)
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {state.config.body_timeout_s:g}s") from None
        except ClientDisconnect:
            raise ClientDisconnected("left during the upload") from None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


@contextlib.contextmanager
def _refusal_counted(request: Request, reason: str, why: str) -> Iterator[None]:
    """A 429 raised within (a read slot not free) is counted, and logged, as a refusal of the
    request's tenant for ``reason`` (``REFUSALS``). (``metrics`` here is the /metrics route.)"""
    try:
        yield
    except TooManyRequests:
        name = getattr(request.state, "tenant_name", "")
        REFUSALS.add(name if isinstance(name, str) else "", reason, why)
        raise


def check_json_media_type(content_type: str | None) -> None:
    """415 unless the body is declared ``application/json`` (parameters such as charset aside).
    A browser sends a cross-origin POST without asking the server first (no CORS preflight) only
    with a form or text/plain type: refusing those keeps any web page from using the API."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        shown = repr(media_type) if media_type else "none"
        raise UnsupportedMediaType(f"the request body must be sent as {JSON_MEDIA_TYPE}, not {shown}")


def _content_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    return int(value) if value is not None and value.isdigit() else None  # the parser rejects bad ones


async def _read_body(request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
    return bytes(body)


@spans.traced
async def completions(request: Request) -> Response:
    if hopmarks.on:
        return await respond(request, _marked(request, protocol.parse_completion, await _read_marked(request)))
    return await respond(request, protocol.parse_completion(await read_json(request)))


@spans.traced
async def chat_completions(request: Request) -> Response:
    if hopmarks.on:
        return await respond(request, _marked(request, protocol.parse_chat, await _read_marked(request)))
    return await respond(request, protocol.parse_chat(await read_json(request)))


async def _read_marked(request: Request) -> Any:
    """``read_json`` with hop marks (``splitbus.bus.core.hopmarks``): the route entered, the body read as
    JSON; kept on the request until it has an id (``generate.prepare``)."""
    request.state.hop_marks = [("api.route", time.time_ns())]
    body = await read_json(request)
    request.state.hop_marks.append(("api.body", time.time_ns()))
    return body


def _marked(request: Request, parse: Callable[[Any], T], body: Any) -> T:
    """``parse(body)``, with its hop mark (``api.parsed``)."""
    params = parse(body)
    request.state.hop_marks.append(("api.parsed", time.time_ns()))
    return params


async def models(request: Request) -> Response:
    state: ApiState = request.state.api
    data = [_model_card(state, name) for name in state.workers.live_models()]
    return JSONResponse({"object": "list", "data": data})


def _model_card(state: ApiState, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "splitbus"}
    if name in state.tokenizers:
        card["max_model_len"] = state.tokenizers[name].context_length
    return card


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    state: ApiState = request.state.api
    try:
        await state.redis.ping()
    except TRANSIENT_ERRORS as exc:
        log.warning("/ready: Redis is unreachable: %s", exc)
        raise ServiceUnavailable("Redis is unreachable") from None
    if not state.workers.redis_ok:  # admission's view: back only once its registry snapshot is too
        raise ServiceUnavailable("Redis is reachable again; the registry view is not refreshed yet")
    live = state.workers.live_models()
    if not live:
        raise ServiceUnavailable("no live worker")
    return JSONResponse({"status": "ready", "models": live})


async def metrics(request: Request) -> Response:
    """This process's metrics, or with ``--workers N`` every process's, summed (``exposition_registry``)."""
    return Response(generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_spec(tuple(sorted(request.state.api.tokenizers))))
