"""API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Each class is one HTTP status; handlers raise them, and one exception handler renders them.
"""

from __future__ import annotations

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

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), self.status, self.headers(), media_type="application/json")

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


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}  # the body is not read: close rather than drain it


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


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


def from_status(status: int, message: str, code: str | None = None) -> ApiError:
    """The error a worker or scheduler asked for (a ``Failed`` entry's status)."""
    return _BY_STATUS.get(status, InternalError)(message, code=code)
