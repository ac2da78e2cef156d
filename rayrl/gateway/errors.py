"""Client-facing errors: each becomes an HTTP 4xx (or 503) with a JSON body in the caller's API dialect.

OpenAI clients expect ``{"error": {"message", "type", "param", "code"}}``; Anthropic clients expect
``{"type": "error", "error": {"type", "message"}}`` (the anthropic SDK and Claude Code read
``error.type`` to decide whether to retry). The gateway picks the shape by route.

A prompt that does not fit is :class:`ContextLengthError`, worded as each API words it, with the
numbers: OpenAI's ``context_length_exceeded`` ("This model's maximum context length is N tokens.
However, your messages resulted in M tokens."), Anthropic's "prompt is too long: M tokens > N
maximum" (the text Claude Code looks for to compact its context).
"""

from __future__ import annotations

from typing import Any

_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
                 413: "request_too_large", 500: "server_error", 503: "service_unavailable"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


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


class ContextLengthError(RequestError):
    """A prompt longer than the engine's context (or ``gateway.max_prompt_tokens``) allows.

    ``tokens`` is the prompt's length, or a lower bound of it when ``exact`` is False (a huge prompt is
    refused before it is tokenized in full). ``maximum`` is the model's context length, or the
    configured prompt limit when ``by_config``.
    """

    def __init__(self, tokens: int, maximum: int, *, exact: bool = True, by_config: bool = False,
                 param: str = "messages") -> None:
        self.tokens, self.maximum, self.exact = tokens, maximum, exact
        count = f"{tokens}" if exact else f"at least {tokens}"
        what = ("This gateway's maximum prompt length (gateway.max_prompt_tokens)" if by_config
                else "This model's maximum context length")
        super().__init__(f"{what} is {maximum} tokens. However, your messages resulted in {count} tokens. "
                         "Please reduce the length of the messages.", param=param, code="context_length_exceeded")

    def anthropic_body(self) -> dict[str, Any]:
        count = f"{self.tokens}" if self.exact else f"at least {self.tokens}"
        return {"type": "error", "error": {"type": "invalid_request_error",
                                           "message": f"prompt is too long: {count} tokens > {self.maximum} maximum"}}
