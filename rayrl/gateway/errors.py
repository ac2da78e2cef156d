"""Client-facing errors: each becomes an HTTP 4xx with an OpenAI-style JSON body."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A problem with the client's request (HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def openai_body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error", 413: "request_too_large"}
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }
