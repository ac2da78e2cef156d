"""Reading and answering HTTP request bodies: the engine server's, the SGLang way, and the gateway's.

Shared by the generate/control routes (server.py), the weight routes (weight_routes.py) and the
gateway (rayrl/gateway/app.py): a bad body raises RequestError, which each server's middleware turns
into its own 4xx JSON error body. :func:`read_body` and :func:`decode_json` are the one place a body
is read and decoded, so every decoding failure is a 4xx naming what was wrong: a ``Content-Encoding``
that is not supported (415: gzip, deflate and identity are) or does not decode (400), a ``charset``
Python does not know (415) or bytes that are not in it (400), JSON that does not parse or nests too
deeply (400); a body larger than the server's limit is a 413, compressed or not (the decoded size is
bounded while decoding, so a small compressed body cannot expand without limit). The servers run with
aiohttp's ``auto_decompress`` off for this: aiohttp would answer an encoding it cannot decode with a
plain-text 400 the app never sees.

Large bodies must not stop a server: callers decode bodies over ``OFF_LOOP_BYTES`` in a worker thread,
and :func:`decode_json` parses a body with many JSON values with the pure-Python scanner (the strings
still decoded in C), which lets other threads, the event loop included, run while it works. The C
parser holds the interpreter for the whole document: 0.4 s for a 20 MB body of small objects.
"""

from __future__ import annotations

import asyncio
import json
import json.scanner
import zlib
from http import HTTPStatus
from typing import Any, Callable

from aiohttp import web

OFF_LOOP_BYTES = 256 * 1024  # bodies larger than this are decoded (and parsed) in a worker thread
_C_PARSE_MAX_VALUES = 20_000  # more JSON values than this (estimated): parse without holding the GIL
_INFLATE_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class RequestError(ValueError):
    """Bad client input: answered with a 4xx JSON error body."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str) -> web.Response:
    """SGLang's error body (the OpenAI-style error object)."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    body = {"object": "error", "message": message, "type": phrase, "param": None, "code": status}
    return web.json_response(body, status=status)


async def read_body(request: web.Request) -> bytes:
    """The request's body, decoded as its ``Content-Encoding`` says (in a worker thread), at most the
    server's ``client_max_size`` bytes after decoding (413 beyond)."""
    try:
        raw = await request.read()
    except (web.HTTPException, asyncio.CancelledError, ConnectionError):
        raise
    except Exception as err:  # a broken chunked body, a payload aiohttp could not read
        raise RequestError(f"the request body could not be read in full: {type(err).__name__}") from None
    header = request.headers.get("Content-Encoding")
    if not header:  # most requests: nothing to undo
        return raw
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    for coding in codings:
        if coding not in _INFLATE_WBITS:
            raise RequestError(f"Content-Encoding {coding!r} is not supported; send gzip, deflate or identity",
                               status=415)
    if codings:
        raw = await asyncio.get_running_loop().run_in_executor(
            None, _decode_content, raw, codings, request.client_max_size
        )
    return raw


def _decode_content(raw: bytes, codings: list[str], max_bytes: int) -> bytes:
    for coding in reversed(codings):  # the last coding applied is undone first
        raw = _inflate(raw, coding, max_bytes)
    return raw


def _inflate(data: bytes, coding: str, max_bytes: int) -> bytes:
    """``data`` decompressed (deflate: zlib-wrapped or raw, as HTTP servers accept both), bounded."""
    attempts = (_INFLATE_WBITS[coding], -zlib.MAX_WBITS) if coding == "deflate" else (_INFLATE_WBITS[coding],)
    reason = ""
    for wbits in attempts:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(data, max_bytes + 1)
        except zlib.error as err:
            reason = str(err)
            continue
        if len(out) > max_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=len(out))
        if not inflater.eof or inflater.unused_data:
            reason = "the compressed stream is truncated" if not inflater.eof else "data after the compressed stream"
            continue
        return out
    raise RequestError(f"the request body does not decode as Content-Encoding {coding!r}: {reason}")


def request_charset(request: web.Request) -> str | None:
    """The ``charset`` of the request's Content-Type, if it names one."""
    try:
        return request.charset
    except Exception:  # an unparseable Content-Type: read the body as JSON's own encodings
        return None


def decode_json(raw: bytes, charset: str | None = None) -> Any:
    """Parse a JSON body: in ``charset`` when the Content-Type names one, else UTF-8/16/32 as JSON allows.

    RequestError for an unknown charset (415), bytes not in it, invalid JSON or too deep nesting (400).
    A body with many values is parsed without holding the GIL for its whole length (module docstring).
    """
    encoding = charset or json.detect_encoding(raw)
    try:
        text = raw.decode(encoding)
    except LookupError:
        raise RequestError(f"unsupported charset {charset!r} in Content-Type; send UTF-8",
                           status=415) from None
    except UnicodeDecodeError as err:
        raise RequestError(f"the request body is not valid {encoding}: {err.reason} "
                           f"at byte {err.start}") from None
    decoder = json.JSONDecoder()
    if len(raw) > OFF_LOOP_BYTES and raw.count(b",") + raw.count(b"{") > _C_PARSE_MAX_VALUES:
        decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as err:
        raise RequestError(f"invalid JSON body: {err}") from None
    except RecursionError:
        raise RequestError("the JSON body is nested too deeply") from None


def json_object(raw: bytes, charset: str | None = None, allow_empty: bool = False) -> dict[str, Any]:
    """A body as a JSON object; an empty body is ``{}`` where the endpoint allows it."""
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestError("the request body is empty; expected a JSON object")
    body = decode_json(raw, charset)
    if body is None and allow_empty:
        return {}
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


async def read_json(request: web.Request, allow_empty: bool = False) -> dict[str, Any]:
    """The request body as a JSON object (decoded in a worker thread when large)."""
    raw = await read_body(request)
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(
            None, json_object, raw, request_charset(request), allow_empty
        )
    return json_object(raw, request_charset(request), allow_empty)


def bool_flag(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be a boolean")
    return value


def per_item(value: Any, n: int, name: str, check: Callable[[Any], bool], default: Any) -> list[Any]:
    """A scalar applies to every batch item; a list must have one entry per item."""
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {n}")
        if not all(check(v) for v in value):
            raise RequestError(f"{name} has an invalid entry")
        return list(value)
    if not check(value):
        raise RequestError(f"{name} has an invalid value {value!r}")
    return [value] * n
