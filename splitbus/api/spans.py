"""The API's spans (docs/metrics.md, "Spans"): ``api.request``, the server span of one
completion request, child of the client's ``traceparent`` header (a bad or absent one starts a
new trace: never a refusal), and within it ``api.admission`` (the overload check and the
tenant's limits), ``api.request_entry`` (the request's entry written, or its tasks with
``--dispatch api``) and ``api.stream_back`` (the first result to the last byte). Each request
entry carries ``api.request``'s traceparent, the parent of the scheduler's and workers' spans.

With tracing off nothing here runs but ``traced``'s first line and ``enter``'s."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Content, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from splitbus import tracing
from splitbus.api.errors import ApiError

Route = Callable[[Request], Awaitable[Response]]


class RequestTrace:
    """One request's ``api.request`` span and the step within it that is open now."""

    def __init__(self, request: Request, route: str) -> None:
        parent = tracing.client_parent(request.headers.get("traceparent"))
        self.span = tracing.start("api.request", parent, attributes={"http.route": route}, server=True)
        self.traceparent = tracing.traceparent(self.span)
        """What the request's bus entries carry."""
        self.step: tracing.Span = None
        self.closed = False

    def enter(self, name: str) -> None:
        """End the open step (if any) and start ``name`` (none if empty)."""
        tracing.end(self.step)
        self.step = tracing.start(name, self.traceparent) if name else None

    def close(self, request: Request, status: int, error: str = "") -> None:
        """The response is sent (or failed): end the open step and the request's span (once: a
        streamed answer's body and its sending both close it, whichever ends first)."""
        if self.closed:
            return
        self.closed = True
        tracing.end(self.step, error=error)
        self.step = None
        request_id = getattr(request.state, "request_id", "")
        attributes = {"http.response.status_code": status, "splitbus.request_id": request_id}
        tracing.end(self.span, error, attributes=attributes)


def traced(route: Route) -> Route:
    """``route`` in an ``api.request`` span (until the last byte of a streamed answer)."""

    async def handler(request: Request) -> Response:
        if not tracing.on:
            return await route(request)
        trace = request.state.trace = RequestTrace(request, request.url.path)
        try:
            response = await route(request)
        except BaseException as exc:
            status = exc.status if isinstance(exc, ApiError) else 500
            trace.close(request, status, type(exc).__name__)
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = _closing(response.body_iterator, request, trace)
            return _SendClosing(response, request, trace)
        trace.close(request, response.status_code)
        return response

    return handler


async def _closing(body: AsyncIterable[Content], request: Request, trace: RequestTrace) -> AsyncIterator[Content]:
    try:
        async for chunk in body:
            yield chunk
    except BaseException as exc:  # the client left mid-stream (cancelled), or the relay failed
        trace.close(request, 200, type(exc).__name__)
        raise
    trace.close(request, 200)


class _SendClosing(Response):
    """A streamed answer whose trace ends however its sending ends: its body closes it at the
    last chunk (``_closing``), but a body never read (sending the response's start failed: the
    client left) would leave it open; here it ends with the error."""

    def __init__(self, streamed: StreamingResponse, request: Request, trace: RequestTrace) -> None:
        # Not Response.__init__ (it renders a body): the streamed answer's own status and headers.
        self.streamed, self.request, self.trace = streamed, request, trace
        self.status_code, self.media_type, self.background = streamed.status_code, streamed.media_type, None
        self.raw_headers = streamed.raw_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.streamed(scope, receive, send)
        except BaseException as exc:
            self.trace.close(self.request, self.status_code, type(exc).__name__)
            raise
        self.trace.close(self.request, self.status_code)


def of(request: Request) -> RequestTrace | None:
    """The request's trace (``traced``), or None: untraced."""
    return getattr(request.state, "trace", None) if tracing.on else None


def enter(trace: RequestTrace | None, name: str) -> None:
    """``RequestTrace.enter`` for a traced request; nothing for another."""
    if trace is not None:
        trace.enter(name)
