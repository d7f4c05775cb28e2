"""Errors in the shape of the API a route belongs to, so official clients raise the right
exception types: OpenAI's everywhere but under `/v1/messages`, which answers Anthropic's."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised by handlers; turned into an OpenAI-shaped JSON error response."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(
    status: int, message: str, param: str | None = None
) -> dict[str, dict[str, str | int | None]]:
    # A message may quote what the client sent; text that is not valid Unicode is shown escaped
    # rather than failing the error response itself.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


# Anthropic's error types by status (its SDK maps the status to an exception class, and shows
# the type and message).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}

ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    kind = _ANTHROPIC_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(
    status: int, message: str, param: str | None = None, path: str = ""
) -> JSONResponse:
    """The error answer for a request to `path` (Anthropic's shape under /v1/messages, where
    `param` has no field of its own and is named in the message)."""
    if path.startswith(ANTHROPIC_PREFIX):
        if param is not None and param not in message:
            message = f"{param}: {message}"
        return JSONResponse(anthropic_error_body(status, message), status_code=status)
    return JSONResponse(error_body(status, message, param), status_code=status)
