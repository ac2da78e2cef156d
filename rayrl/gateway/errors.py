"""Client-facing errors: each becomes an HTTP 4xx (or 503) with a JSON body in the caller's API dialect.

OpenAI clients expect ``{"error": {"message", "type", "param", "code"}}``; Anthropic clients expect
``{"type": "error", "error": {"type", "message"}}`` (the anthropic SDK and Claude Code read
``error.type`` to decide whether to retry). The gateway picks the shape by route.
"""

from __future__ import annotations

from typing import Any

_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
                 413: "request_too_large", 500: "server_error", 503: "service_unavailable"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class RequestError(Exception):
    """A problem with the client's request (HTTP 4xx), or an engine outage (503)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _OPENAI_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(self.status, "invalid_request_error"), "message": self.message},
        }
