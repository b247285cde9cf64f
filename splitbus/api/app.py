"""The Starlette application: routes, middleware, error handlers, and state in the lifespan."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import uuid
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitbus import aio
from splitbus.api import metrics, routes, tokens
from splitbus.api.config import ApiConfig
from splitbus.api.errors import (
    INTERNAL_MESSAGE,
    ApiError,
    InternalError,
    MethodNotAllowed,
    MisdirectedRequest,
    NotFound,
    ServiceUnavailable,
    Unauthorized,
)
from splitbus.api.generate import ClientDisconnected
from splitbus.api.limits import with_headers
from splitbus.api.state import ApiState
from splitbus.api.tenants import ANONYMOUS, Authenticator, Caller, LookupFailed
from splitbus.bus.limits import limited

log = logging.getLogger(__name__)

ROUTES = [
    Route("/v1/completions", routes.completions, methods=["POST"]),
    Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
    Route("/v1/models", routes.models, methods=["GET"]),
    Route("/health", routes.health, methods=["GET"]),
    Route("/ready", routes.ready, methods=["GET"]),
    Route("/metrics", routes.metrics, methods=["GET"]),
    Route("/openapi.json", routes.openapi, methods=["GET"]),
    Route("/tokenize", tokens.tokenize, methods=["POST"]),
    Route("/detokenize", tokens.detokenize, methods=["POST"]),
    Route("/tokenizer_info", tokens.tokenizer_info, methods=["GET"]),
]
ROUTE_PATHS = {route.path for route in ROUTES}
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})
"""Beside ``/v1/*``, the routes that need an API key when keys are set: vLLM's tokenizer routes
(at the root, where vLLM serves them) do a model's work for the caller."""


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

    app = Starlette(routes=ROUTES, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.exit_code = 0
    app.state.metrics_registry = metrics.exposition_registry()
    app.add_middleware(RequireApiKey)
    app.add_middleware(RequireKnownHost, names=known_host_names(config))
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
    # The exception's text stays in the log: the client gets a stable message and the id to
    # find it by (the generation's own id once it has one, else one made here).
    request_id = getattr(request.state, "request_id", None) or f"req-{uuid.uuid4().hex}"
    log.exception("unhandled error on %s, request id %s", request.url.path, request_id)
    return InternalError(INTERNAL_MESSAGE).for_request(request_id).response()


EXCEPTION_HANDLERS = {
    ApiError: _api_error,
    HTTPException: _http_error,
    ClientDisconnected: _disconnected,
    ClientDisconnect: _disconnected,  # starlette's own, from any other read of the body
    Exception: _unexpected,
}


class RequireApiKey:
    """Bearer keys on ``/v1/*`` and the tenant routes (``needs_key``) once keys are required
        (``Authenticator.required``: keys given at start, or tenants in the store); probes and metrics
        stay open. The key names the request's tenant (splitbus.api.tenants): ``request.state``'s
        ``tenant_name`` and ``tenant_limits`` (for admission), and ``tenant``, whose cached prompts it
        may reuse. An unknown key is 401; one Redis cannot be read for (and never was) 503. Every
    response to a tenant with limits carries its admission's ``x-ratelimit-*`` headers
    (``splitbus.api.limits``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                caller = await self._caller(scope)
            except ApiError as refused:
                await refused(scope, receive, send)
                return
            state = scope.setdefault("state", {})
            state.update(tenant=caller.cache, tenant_name=caller.name, tenant_limits=caller.limits)
            if limited(caller.limits):  # its admission's x-ratelimit-* headers go on every response
                send = with_headers(state, send)
        await self.app(scope, receive, send)

    async def _caller(self, scope: Scope) -> Caller:
        """The request's tenant: ``ANONYMOUS`` where no key is needed; else its key's, or an error."""
        auth = _authenticator(scope)
        if not needs_key(scope["path"]) or not auth.required:
            return ANONYMOUS
        try:
            caller = await auth.caller(_bearer(scope))
        except LookupFailed:
            raise ServiceUnavailable(
                "the API key cannot be checked now (Redis is not reachable); retry later"
            ) from None
        if caller is None:
            raise Unauthorized("Incorrect or missing API key; send 'Authorization: Bearer <key>'")
        return caller


def _authenticator(scope: Scope) -> Authenticator:
    """The process's ``Authenticator``, from the lifespan's state."""
    auth: Authenticator = scope["state"]["api"].auth
    return auth


def _bearer(scope: Scope) -> bytes:
    """The request's bearer token (b"" for none)."""
    header = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = header.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def needs_key(path: str) -> bool:
    return path.startswith("/v1/") or path in KEYED_PATHS


LOCAL_NAMES = frozenset({"localhost"})
"""Host names a server without API keys always answers to, beside IP addresses."""


def known_host_names(config: ApiConfig) -> frozenset[str] | None:
    """The Host names ``/v1/*`` answers to; None: any (API keys are the guard, or the operator
    allowed every name with ``--allowed-hosts '*'``)."""
    if config.api_keys or "*" in config.allowed_hosts:
        return None
    return LOCAL_NAMES | {_host_name(config.host)} | {_host_name(name) for name in config.allowed_hosts}


def host_is_known(host: str, names: frozenset[str]) -> bool:
    """Whether a Host header names this server: an IP address (a literal address cannot be
    rebound by DNS, and a page on another origin cannot read its answers: no CORS), or one of
    ``names``. The port is not compared: a proxy in front may forward its own."""
    name = _host_name(host)
    return name in names or _is_ip_address(name)


def _host_name(host: str) -> str:
    """``Host``'s name: without its port or IPv6 brackets, lower case, no trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        host = name
    return host.rstrip(".")


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class RequireKnownHost:
    """Without API keys (none given at start, no tenant in the store), the API serves only
    requests whose Host names this server (421
    otherwise): a web page that rebinds its own domain name to this address (DNS rebinding)
    sends its domain as the Host, and is refused before it can read an answer, the probes',
    the metrics' and the OpenAPI document's included (they name the served models). A probe
    dials an address, which is a known name; a request without a Host is not a browser's."""

    def __init__(self, app: ASGIApp, names: frozenset[str] | None) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.names is not None and not _authenticator(scope).required:
            host = dict(scope["headers"]).get(b"host")
            if host is not None and not host_is_known(host.decode("latin-1"), self.names):
                refused = MisdirectedRequest(
                    "this server does not answer to that Host name; use its address, or start it with "
                    "--allowed-hosts (or an API key)"
                )
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
