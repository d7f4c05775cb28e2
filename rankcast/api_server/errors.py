"""Errors in the OpenAI error shape, so official clients raise the right exception types."""

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


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)
