"""API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Each class is one HTTP status; handlers raise them, and one exception handler renders them.
What a client reads is the API's own text: an error from a worker, the scheduler or the
server itself gets a stable message for its code and the request's id, and the detail it
carried (worker ids, peers, exception text) goes to the log only, under that id.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from starlette.responses import Response


class ApiError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.code
        self.request_id: str | None = None

    def for_request(self, request_id: str) -> ApiError:
        """This error, naming the request it ended (in its message and ``x-request-id``), so
        that what the client reports can be found in the log."""
        self.request_id = request_id
        self.message = f"{self.message} (request id {request_id})"
        return self

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {}

    def response(self) -> Response:
        named = {"x-request-id": self.request_id} if self.request_id else {}
        headers = {**self.headers(), **named}
        return Response(orjson.dumps(self.body()), self.status, headers, media_type="application/json")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Send this error as the whole response (for middleware, which has no handlers)."""
        await self.response()(scope, receive, send)


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MisdirectedRequest(ApiError):
    status = 421
    type = "invalid_request_error"
    code = "misdirected_request"


class MethodNotAllowed(ApiError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeout(ApiError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}  # the rest of the body may still come: do not parse it as a request


class BodyNotRead(ApiError):
    """Refused before its body was read."""

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}  # the body is not read: close rather than drain it


class PayloadTooLarge(BodyNotRead):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(BodyNotRead):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class ChatTemplateLimitExceeded(BadRequest):
    code = "chat_template_limit"


class TooManyRequests(ApiError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int = 1, close: bool = False, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s
        self.close = close

    def headers(self) -> dict[str, str]:
        closing = {"Connection": "close"} if self.close else {}  # refused before its body was read
        return {"Retry-After": str(self.retry_after_s), **closing}


class ServiceUnavailable(ApiError):
    status = 503
    type = "service_unavailable_error"
    code = "service_unavailable"

    def __init__(self, message: str, retry_after_s: int | None = None, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s
        """When to come back (``Retry-After``), where the API can say: an early refusal."""

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


class GatewayTimeout(ApiError):
    status = 504
    type = "timeout_error"
    code = "timeout"


class InternalError(ApiError):
    status = 500
    type = "server_error"
    code = "internal_error"


_BY_STATUS = {
    cls.status: cls
    for cls in (
        BadRequest,
        Unauthorized,
        NotFound,
        PayloadTooLarge,
        TooManyRequests,
        ServiceUnavailable,
        GatewayTimeout,
    )
}


FAILURE_MESSAGES = {
    "deadline": "The request's deadline passed before it finished",
    "no_worker": "No worker could take this request in time; retry later",
    "worker_died": "The worker serving this request stopped before it finished; retry",
    "out_of_kv_blocks": "The workers have no KV cache room for this request; retry later, or shorten it",
    "kv_transfer_failed": "Handing this request's KV cache between workers failed; retry",
    "dp_group_broken": "The worker group serving this request failed; retry",
    "results_lost": "Part of this request's results was lost on the bus; retry",
    "engine_error": "The engine failed on this request",
    "invalid_grammar": "The workers could not build this request's structured-output grammar",
}
"""The client's message for each code a worker or scheduler fails a request with (the codes
are in the workers' and the scheduler's ``fail`` calls); any other code gets its status's."""
STATUS_MESSAGES = {
    400: "The workers refused this request",
    429: "The workers are busy; retry later",
    503: "The service could not serve this request now; retry later",
    504: "The request did not finish in time",
}
INTERNAL_MESSAGE = "The server had an error while processing this request"
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
"""A code as the bus's parties write them (``out_of_kv_blocks``); anything else, such as a
dead letter's reason that is not one, reaches the client as ``worker_error``."""


def from_failure(status: int, code: str, request_id: str) -> ApiError:
    """The client's error for a ``Failed`` entry: its status and code, a stable message for
    the code, and the request id; never the entry's own message (the caller logs it)."""
    cls = _BY_STATUS.get(status, InternalError)
    code = code if _CODE.fullmatch(code) else "worker_error"
    message = FAILURE_MESSAGES.get(code) or STATUS_MESSAGES.get(cls.status, INTERNAL_MESSAGE)
    return cls(message, code=code).for_request(request_id)
