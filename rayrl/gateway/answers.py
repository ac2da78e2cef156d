"""The gateway's JSON answers to LLM calls, encoded with orjson.

Why: the answer of every non-streamed call is encoded on the event loop; aiohttp's ``json_response``
(the standard library's encoder, then text re-encoded to bytes) takes two to three times as long as
orjson's bytes for a chat completion, on the per-call path whose added latency the gateway is measured
by (bench/gateway_overhead.py). The answer is the same JSON: the same values, only written without the
standard library's spaces and with non-ASCII text as UTF-8 rather than ``\\u`` escapes (the body is
declared ``charset=utf-8`` either way). What orjson refuses (a lone surrogate in a string, an integer
beyond 64 bits) is encoded by the standard library as before. orjson writes a NaN or infinite float as
``null`` where the standard library writes ``NaN``/``Infinity``: callers use this only for answers whose
floats are finite (Chat Completions checks its log-probs; the other APIs echo request values and keep
aiohttp's encoder).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from aiohttp import web


def json_response(data: Any, status: int = 200) -> web.Response:
    """``web.json_response(data, status=status)``, encoded with orjson where it can."""
    try:
        body = orjson.dumps(data)
    except (orjson.JSONEncodeError, TypeError):
        body = json.dumps(data).encode()
    return web.Response(body=body, status=status, content_type="application/json", charset="utf-8")
