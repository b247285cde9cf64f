"""Route handlers. Each parses, delegates, and returns; errors are raised as ApiError."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from splitbus.api import protocol
from splitbus.api.errors import BadRequest, PayloadTooLarge, ServiceUnavailable
from splitbus.api.generate import generate
from splitbus.api.openapi import openapi_spec
from splitbus.api.state import ApiState
from splitbus.bus.connection import TRANSIENT_ERRORS


async def read_json(request: Request) -> Any:
    """The body as JSON, refusing more than the configured size even without Content-Length."""
    limit = request.state.api.config.max_body_bytes
    if int(request.headers.get("content-length") or 0) > limit:
        raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


async def completions(request: Request) -> Response:
    return await generate(request, protocol.parse_completion(await read_json(request)))


async def chat_completions(request: Request) -> Response:
    return await generate(request, protocol.parse_chat(await read_json(request)))


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
        raise ServiceUnavailable(f"Redis is unreachable: {exc}") from None
    live = state.workers.live_models()
    if not live:
        raise ServiceUnavailable("no live worker")
    return JSONResponse({"status": "ready", "models": live})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_spec(tuple(sorted(request.state.api.tokenizers))))
