"""The Starlette application: routes, middleware, error handlers, and state in the lifespan."""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitbus import aio
from splitbus.api import metrics, routes
from splitbus.api.config import ApiConfig
from splitbus.api.errors import ApiError, InternalError, MethodNotAllowed, NotFound, Unauthorized
from splitbus.api.generate import ClientDisconnected
from splitbus.api.state import ApiState
from splitbus.api.tenants import NO_TENANT, tenant_of

log = logging.getLogger(__name__)

ROUTES = [
    Route("/v1/completions", routes.completions, methods=["POST"]),
    Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
    Route("/v1/models", routes.models, methods=["GET"]),
    Route("/health", routes.health, methods=["GET"]),
    Route("/ready", routes.ready, methods=["GET"]),
    Route("/metrics", routes.metrics, methods=["GET"]),
    Route("/openapi.json", routes.openapi, methods=["GET"]),
]
ROUTE_PATHS = {route.path for route in ROUTES}


def create_app(config: ApiConfig) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, ApiState]]:
        state = await ApiState.open(config)
        aio.freeze_heap()  # the tokenizers, the routes: built, and scanned by no collection from now
        log.info("API %s ready; models: %s", config.node_id, ", ".join(state.tokenizers) or "none")
        try:
            yield {"api": state}
        finally:
            await state.close()
            app.state.exit_code = state.loops.exit_code  # non-zero: a background loop failed

    app = Starlette(routes=ROUTES, lifespan=lifespan, exception_handlers=_EXCEPTION_HANDLERS)
    app.state.exit_code = 0
    app.add_middleware(RequireApiKey, keys=config.api_keys)
    app.add_middleware(CountRequests)
    return app


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}").response()
    return NotFound(f"no route {request.url.path}").response()


async def _disconnected(request: Request, exc: Exception) -> Response:
    # Nobody reads it: it ends the request quietly (no traceback), counted as 499 in
    # splitbus_api_requests_total, as nginx logs a client that closed its connection.
    return Response(status_code=499)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return InternalError("internal error; see the server log").response()


_EXCEPTION_HANDLERS = {
    ApiError: _api_error,
    HTTPException: _http_error,
    ClientDisconnected: _disconnected,
    ClientDisconnect: _disconnected,  # starlette's own, from any other read of the body
    Exception: _unexpected,
}


class RequireApiKey:
    """Bearer keys on ``/v1/*`` when keys are configured; probes and metrics stay open. The key a
    request came with names its tenant (``request.state.tenant``, splitbus.api.tenants): whose
    cached prompts it may reuse."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = [(key.encode(), tenant_of(key)) for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            tenant = self._tenant(scope) if self.keys else NO_TENANT
            if tenant is None and scope["path"].startswith("/v1/"):
                await Unauthorized("Incorrect or missing API key; send 'Authorization: Bearer <key>'")(
                    scope, receive, send
                )
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    def _tenant(self, scope: Scope) -> bytes | None:
        """The tenant of the request's bearer key; None for a missing or unknown key."""
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        return next((tenant for key, tenant in self.keys if hmac.compare_digest(token.strip(), key)), None)


class CountRequests:
    """``splitbus_api_requests_total`` by route template and status (bounded labels)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTE_PATHS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                metrics.REQUESTS.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
