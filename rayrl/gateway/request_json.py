"""A request body's bytes to the JSON object an LLM route takes, or a 4xx naming what was wrong.

Why its own module: the gateway's hot path parses small UTF-8 bodies with orjson, and everything orjson
might read differently from the standard library (other charsets, 19-digit integers, large bodies) goes
the standard library's way (http_input.json_object), so both paths accept and refuse alike; a lone
UTF-16 surrogate, which only an escape can carry, is refused naming its field.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from rayrl.engines import http_input
from rayrl.gateway.errors import RequestError
from rayrl.gateway.params import lone_surrogate_path

_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")

_LONG_NUMBER = re.compile(rb"[0-9]{19}")  # an integer orjson may not keep exact (it reads those as floats)


def fast_json_object(raw: bytes, charset: str | None) -> dict[str, Any] | None:
    """A small UTF-8 body that is a JSON object, parsed with orjson (a few times faster than the standard
    library on a call's body); None for anything else, which the standard library's path then decodes or
    refuses with its own messages. orjson accepts only what that path accepts alike: it refuses lone
    surrogates, ``NaN``/``Infinity``, a byte-order mark and numbers out of float range, and the 19-digit
    check sends integers it would turn into floats to the standard library. Large bodies keep that path
    (it parses them without holding the interpreter for their whole length: http_input.decode_json)."""
    if len(raw) > http_input.OFF_LOOP_BYTES:
        return None
    if charset is not None and charset.lower().replace("_", "-") not in ("utf-8", "utf8"):
        return None
    if _LONG_NUMBER.search(raw) is not None:
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


def decode_object(raw: bytes, charset: str | None) -> dict[str, Any]:
    """The body as a JSON object (orjson where it reads alike, else the standard library's path)."""
    body = fast_json_object(raw, charset)
    if body is not None:
        return body
    try:
        body = http_input.json_object(raw, charset)
    except http_input.RequestError as err:
        raise RequestError(str(err), status=err.status) from None
    encoding = (charset or json.detect_encoding(raw)).lower().replace("_", "-")
    utf8 = encoding in ("utf-8", "utf8", "utf-8-sig", "ascii", "us-ascii")
    if not utf8 or _ESCAPED_SURROGATE.search(raw):  # a lone surrogate can only come from an escape
        where = lone_surrogate_path(body)
        if where is not None:
            raise RequestError(f"{where}: the string holds a lone UTF-16 surrogate, which is not valid "
                               "Unicode", param=where)
    return body
