"""Errors the router answers with, always in the OpenAI shape.

    {"error": {"message": str, "type": str, "param": str | None, "code": int}}

`code` is the HTTP status, as vLLM sends it; `type` follows OpenAI's names.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """Raised anywhere in request handling; the app turns it into the JSON error response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        # A 503 is temporary (a replica restarting, a stack draining): say when to try again.
        self.headers = headers if headers or status != 503 else {"Retry-After": "1"}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.type)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, type: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def unavailable(message: str) -> APIError:
    return APIError(503, message)
