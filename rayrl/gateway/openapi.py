"""The gateway's OpenAPI 3.1 description, served at ``GET /openapi.json``.

It documents what the gateway accepts (the subset of each vendor API it implements, with the fields
it reads) and what every error looks like. Request schemas are deliberately open
(``additionalProperties`` allowed): real clients send many fields the gateway ignores. Each operation
carries an ``example`` request body; the fuzz test (tests/gateway/test_fuzz.py) walks every operation
here and mutates those examples, so a new route without an entry here is caught by the test that
compares this spec with the app's routes.
"""

from __future__ import annotations

import copy
from typing import Any

_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                                         "properties": {"type": {"type": "string"},
                                                                        "message": {"type": "string"}}}},
}

_CHAT_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"type": ["string", "array", "null"], "items": {"type": "object", "properties": {
            "type": {"enum": ["text", "input_text", "output_text"]}, "text": {"type": "string"}}}},
        "tool_calls": {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
            "id": {"type": "string"}, "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "minLength": 1}, "arguments": {"type": "string"}}}}}},
        "tool_call_id": {"type": "string"},
        "name": {"type": "string"},
    },
}
_FUNCTION_TOOL = {
    "type": "object",
    "required": ["function"],
    "properties": {"type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}},
}
_SAMPLING = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "stream": {"type": "boolean"},
    "model": {"type": "string", "description": "any name is accepted unless gateway.served_model_names is set"},
}

CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **_SAMPLING,
        "messages": {"type": "array", "minItems": 1, "items": _CHAT_MESSAGE},
        "tools": {"type": "array", "items": _FUNCTION_TOOL},
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string", "minLength": 1}}}}}],
            "description": "'none' hides the tools; 'required' and a named function force a call (docs/gateway.md)"},
        "parallel_tool_calls": {"type": "boolean", "description": "false: at most one tool call"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "stop": {"type": ["string", "array"], "items": {"type": "string"}, "maxItems": 16},
        "n": {"const": 1},
        "seed": {"type": "integer"},
        "logprobs": {"type": "boolean"},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    },
}
RESPONSES_REQUEST = {
    "type": "object",
    "required": ["input"],
    "properties": {
        **_SAMPLING,
        "instructions": {"type": "string"},
        "input": {"type": ["string", "array"], "items": {"type": "object", "properties": {
            "type": {"enum": ["message", "function_call", "function_call_output", "reasoning",
                              "custom_tool_call", "custom_tool_call_output", "item_reference"]},
            "role": {"enum": ["user", "assistant", "system", "developer"]},
            "content": {"type": ["string", "array"]},
            "call_id": {"type": "string"}, "name": {"type": "string"}, "arguments": {"type": "string"},
            "output": {"type": ["string", "array"]}}}},
        "tools": {"type": "array", "description": "function tools are used; other types are skipped",
                  "items": {"type": "object", "required": ["type"], "properties": {
                      "type": {"type": "string"}, "name": {"type": "string"},
                      "parameters": {"type": "object"}, "description": {"type": "string"}}}},
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "name"], "properties": {
                "type": {"const": "function"}, "name": {"type": "string", "minLength": 1}}}]},
        "parallel_tool_calls": {"type": "boolean", "description": "false: at most one tool call"},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "previous_response_id": {"type": "null", "description": "not supported: replay the input"},
    },
}
_ANTHROPIC_BLOCKS = {"type": ["string", "array"], "items": {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document"]},
    "text": {"type": "string"}, "id": {"type": "string"}, "name": {"type": "string"}, "input": {"type": "object"},
    "tool_use_id": {"type": "string"}, "content": {"type": ["string", "array"]}, "is_error": {"type": "boolean"}}}}
MESSAGES_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **_SAMPLING,
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "max_tokens": {"type": "integer", "minimum": 1},
        "system": {"type": ["string", "array"]},
        "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
                                                               "properties": {
            "role": {"enum": ["user", "assistant", "system"]}, "content": _ANTHROPIC_BLOCKS}}},
        "tools": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
            "input_schema": {"type": "object"}, "type": {"type": "string"}}}},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string", "minLength": 1,
                                                                       "description": "with type 'tool'"},
            "disable_parallel_tool_use": {"type": "boolean"}}},
        "stop_sequences": {"type": "array", "items": {"type": "string"}, "maxItems": 16},
        "top_k": {"type": "integer", "minimum": 1},
        "thinking": {"type": "object", "description": "accepted (enabled, disabled, adaptive); no effect"},
    },
}
COUNT_TOKENS_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {k: MESSAGES_REQUEST["properties"][k] for k in ("model", "system", "messages", "tools")},
}

EXAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/chat/completions"): {
        "model": "any", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "calc"}}, "parallel_tool_calls": False,
    },
    ("post", "/v1/responses"): {
        "model": "any", "max_output_tokens": 4, "temperature": 0, "instructions": "Be brief.",
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": [{"type": "function", "name": "calc", "parameters": {"type": "object"}},
                  {"type": "web_search"}],
        "tool_choice": "required",
    },
    ("post", "/v1/messages"): {
        "model": "claude-opus-4-8", "max_tokens": 4, "temperature": 0,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "Bash", "disable_parallel_tool_use": True},
        "thinking": {"type": "adaptive"},
    },
    ("post", "/v1/messages/count_tokens"): {
        "model": "claude-opus-4-8", "messages": [{"role": "user", "content": "hi"}],
    },
    ("post", "/rayrl/sessions"): {"metadata": {"task": "t"}},
    ("post", "/rayrl/sessions/{session_id}/finish"): {"reward": 1.0},
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(anthropic: bool = False) -> dict[str, Any]:
    schema = _ANTHROPIC_ERROR if anthropic else _OPENAI_ERROR
    return {
        "400": {"description": "malformed request (names the field)", "content": _json(schema)},
        "401": {"description": "missing or unknown session token", "content": _json(schema)},
        "404": {"description": "unknown model (only with served_model_names) or route", "content": _json(schema)},
        "409": {"description": "the session has finished", "content": _json(schema)},
        "413": {"description": "body larger than gateway.max_body_mb", "content": _json(schema)},
        "503": {"description": "no engine could serve the request", "content": _json(schema)},
    }


def _post(summary: str, schema: dict[str, Any], key: tuple[str, str], ok: str, anthropic: bool = False,
          security: str = "session") -> dict[str, Any]:
    return {
        "summary": summary,
        "security": [{"sessionBearer": []}, {"sessionApiKey": []}] if security == "session" else [{"adminBearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema,
                                                                           "example": EXAMPLES[key]}}},
        "responses": {"200": {"description": ok, "content": {"application/json": {"schema": {"type": "object"}},
                                                           "text/event-stream": {"schema": {"type": "string"}}}},
                      **_errors(anthropic)},
    }


def _get(summary: str, security: str | None = None) -> dict[str, Any]:
    ok = {"description": "OK", "content": _json({"type": "object"})}
    op: dict[str, Any] = {"summary": summary, "responses": {"200": ok}}
    if security:
        op["security"] = [{"adminBearer": []}]
        op["responses"].update({k: v for k, v in _errors().items() if k in ("401", "404")})
    return op


def openapi_spec() -> dict[str, Any]:
    """The spec (a fresh copy: callers may mutate it)."""
    sid = [{"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    spec = {
        "openapi": "3.1.0",
        "info": {"title": "rayrl gateway", "version": "1",
                 "description": "OpenAI- and Anthropic-compatible endpoints that record every call token for "
                                "token. Session tokens come from POST /rayrl/sessions (admin token)."},
        "components": {"securitySchemes": {
            "sessionBearer": {"type": "http", "scheme": "bearer", "description": "a session token"},
            "sessionApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            "adminBearer": {"type": "http", "scheme": "bearer", "description": "the gateway's admin token"},
        }},
        "paths": {
            "/v1/chat/completions": {"post": _post("OpenAI Chat Completions", CHAT_REQUEST,
                                                   ("post", "/v1/chat/completions"), "chat.completion or SSE chunks")},
            "/v1/responses": {"post": _post("OpenAI Responses (stateless)", RESPONSES_REQUEST,
                                            ("post", "/v1/responses"), "response or SSE events")},
            "/v1/messages": {"post": {
                **_post("Anthropic Messages", MESSAGES_REQUEST, ("post", "/v1/messages"), "message or SSE events",
                        anthropic=True),
                "parameters": [{"name": "beta", "in": "query", "required": False, "schema": {"type": "string"}}]}},
            "/v1/messages/count_tokens": {"post": _post("Anthropic token counting", COUNT_TOKENS_REQUEST,
                                                        ("post", "/v1/messages/count_tokens"), "{input_tokens}",
                                                        anthropic=True)},
            "/v1/models": {"get": _get("the served model names")},
            "/health": {"get": _get("liveness and open sessions")},
            "/": {"get": _get("liveness (HEAD / is Claude Code's connectivity check)")},
            "/openapi.json": {"get": _get("this document")},
            "/rayrl/stats": {"get": _get("the gateway's counters, sessions and duration summaries "
                                         "(rayrl/gateway/admin_stats.py)", "admin")},
            "/rayrl/sessions": {"post": _post("open a session: {session_id, token, base_url}",
                                              {"type": "object", "properties": {"metadata": {"type": "object"}}},
                                              ("post", "/rayrl/sessions"), "the session", security="admin")},
            "/rayrl/sessions/{session_id}": {"get": {**_get("a session's trajectory-tree stats", "admin"),
                                                     "parameters": sid}},
            "/rayrl/sessions/{session_id}/tree": {"get": {
                **_get("an open session's turn tree for inspection (rayrl/gateway/admin_trees.py); 400 names "
                       "text_chars when it is not an integer in 0..1000000", "admin"),
                "parameters": sid + [{"name": "text_chars", "in": "query", "required": False,
                                      "schema": {"type": "integer", "minimum": 0, "maximum": 1000000}}]}},
            "/rayrl/sessions/{session_id}/finish": {"post": {
                **_post("finish a session: its samples as JSON",
                        {"type": "object", "required": ["reward"], "properties": {"reward": {"type": "number"}}},
                        ("post", "/rayrl/sessions/{session_id}/finish"), "stats and samples", security="admin"),
                "parameters": sid}},
        },
    }
    return copy.deepcopy(spec)
