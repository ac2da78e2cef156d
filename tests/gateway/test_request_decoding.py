"""Request decoding and validation, as a new user and an attacker send them, in each API's dialect.

Every failure to decode a body (its Content-Encoding, its charset, its JSON, its size, a lone surrogate)
is a 4xx with a JSON body in the route's dialect that says what was wrong, and a lone surrogate's error
names its field. Validation matches the real APIs for the cases clients hit: Anthropic requires
``max_tokens`` and pairs ``tool_use`` with ``tool_result`` blocks, OpenAI pairs tool messages (and
Responses ``function_call_output`` items) with calls. Every non-2xx answer is logged once, in one line
with method, path, status, session and reason; an in-stream error gets the same one line.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib

import httpx
import pytest

from tests.gateway.scripted_engine import ENGINE_ABORT

CHAT = {"messages": [{"role": "user", "content": "hi é"}], "max_tokens": 4}
MSGS = {"model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
ROUTES = [("/v1/chat/completions", CHAT), ("/v1/messages", MSGS), ("/v1/responses", {"input": "hi"})]


@pytest.fixture
def stack(scripted):
    return scripted(lambda prompt: "ok")


def _post(stack, info, path: str, content: bytes, **headers: str) -> httpx.Response:
    return stack.http.post(stack.root + path, content=content, timeout=60,
                      headers={"Authorization": f"Bearer {info.token}", "Content-Type": "application/json", **headers})


def _error(resp: httpx.Response, path: str) -> dict:
    body = resp.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


@pytest.mark.parametrize("path,body", ROUTES)
def test_content_encodings(stack, path, body):
    info = stack.open()
    raw = json.dumps(body).encode()
    assert _post(stack, info, path, gzip.compress(raw), **{"Content-Encoding": "gzip"}).status_code == 200
    assert _post(stack, info, path, zlib.compress(raw), **{"Content-Encoding": "deflate"}).status_code == 200
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw_deflate = raw_deflate.compress(raw) + raw_deflate.flush()
    assert _post(stack, info, path, raw_deflate, **{"Content-Encoding": "deflate"}).status_code == 200
    twice = gzip.compress(zlib.compress(raw))  # deflate applied first, then gzip
    assert _post(stack, info, path, twice, **{"Content-Encoding": "deflate, gzip"}).status_code == 200
    for encoding, content, status in [("gzip", raw, 400), ("gzip", gzip.compress(raw)[:-9], 400),
                                      ("gzip", gzip.compress(raw) + b"junk", 400), ("deflate", b"\x00junk" * 40, 400),
                                      ("br", raw, 415), ("zstd", raw, 415), ("rot13", raw, 415)]:
        r = _post(stack, info, path, content, **{"Content-Encoding": encoding})
        assert r.status_code == status, (encoding, r.status_code, r.text)
        assert "Content-Encoding" in _error(r, path)["message"]
    assert stack.gateway.counters["errors_internal"] == 0


@pytest.mark.parametrize("path,body", ROUTES)
def test_charsets_and_json(stack, path, body):
    info = stack.open()
    text = json.dumps(body, ensure_ascii=False)
    for charset in ("utf-8", "latin-1", "utf-16"):
        r = _post(stack, info, path, text.encode(charset), **{"Content-Type": f"application/json; charset={charset}"})
        assert r.status_code == 200, (charset, r.text)
    if path == "/v1/chat/completions":  # the declared charset was honoured: é reached the model as é
        assert stack.engine.prompts[-1].count("hi é") == 1
    assert _post(stack, info, path, text.encode("utf-16")).status_code == 200  # JSON's own detection
    cases = [
        (text.encode(), {"Content-Type": "application/json; charset=klingon"}, 415, "charset"),
        (text.encode("latin-1") + b"\xff\xfe", {}, 400, "utf-8"),
        (b'{"messages": [', {}, 400, "JSON"),
        (b"[" * 100_000 + b"]" * 100_000, {}, 400, "nested too deeply"),
        (b"", {}, 400, "empty"),
        (b'"just a string"', {}, 400, "JSON object"),
    ]
    for content, headers, status, words in cases:
        r = _post(stack, info, path, content, **headers)
        assert r.status_code == status, (content[:30], r.text)
        assert words in _error(r, path)["message"]


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ok \\ud800 bad"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]},
     "messages[0].content[0].text"),
    ("/v1/messages", {"max_tokens": 4, "system": "s\\udc00", "messages": [{"role": "user", "content": "hi"}]},
     "system"),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi"}], "instructions": "\\ud83d"}, "instructions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "\\ud800key": 1}, "\\ud800key"),
])
def test_a_lone_surrogate_names_its_field(stack, path, body, field):
    info = stack.open()
    raw = json.dumps(body).replace("\\\\u", "\\u")  # "\\ud800" in the test's text: a JSON escape on the wire
    r = _post(stack, info, path, raw.encode())
    assert r.status_code == 400
    error = _error(r, path)
    named = field.encode().decode("unicode_escape")
    assert "surrogate" in error["message"] and named in error["message"]
    if not path.startswith("/v1/messages"):
        assert error["param"] == named


def test_a_surrogate_pair_is_an_ordinary_character(stack):
    info = stack.open()
    raw = json.dumps(CHAT).replace("\\u00e9", "\\ud83d\\ude00").encode()  # an escaped emoji
    assert b"\\ud83d\\ude00" in raw and _post(stack, info, "/v1/chat/completions", raw).status_code == 200
    assert "\U0001f600" in stack.engine.prompts[-1]


def test_oversized_body_is_413_in_both_dialects(scripted):
    from rayrl.config import GatewayConfig

    stack = scripted(lambda p: "ok", cfg=GatewayConfig(tool_parser="hermes", max_body_mb=0.05))
    info = stack.open()
    raw = gzip.compress(json.dumps({**MSGS, "messages": [{"role": "user", "content": "x" * 200_000}]}).encode())
    for path in ("/v1/messages", "/v1/chat/completions"):  # compressed: small on the wire, too large decoded
        r = _post(stack, info, path, raw, **{"Content-Encoding": "gzip"})
        assert r.status_code == 413 and "MB" in r.json()["error"]["message"]


def test_anthropic_validation_matches_the_real_api(stack):
    info = stack.open()
    post = lambda body: _post(stack, info, "/v1/messages", json.dumps(body).encode())  # noqa: E731
    no_max = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = post(no_max)
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens: Field required"
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
    orphan = {**MSGS, "messages": [{"role": "user", "content": "go"}, use,
                                   {"role": "user", "content": [{**result, "tool_use_id": "toolu_9"}]}]}
    r = post(orphan)
    assert r.status_code == 400
    assert "messages[2].content[0]: unexpected `tool_use_id` found in `tool_result` blocks: toolu_9" in r.text
    first = {**MSGS, "messages": [{"role": "user", "content": [result]}]}
    assert post(first).status_code == 400
    unanswered = {**MSGS, "messages": [{"role": "user", "content": "go"}, use, {"role": "user", "content": "and?"}]}
    r = post(unanswered)
    assert r.status_code == 400 and "`tool_use` ids were found without `tool_result` blocks" in r.text
    good = {**MSGS, "messages": [{"role": "user", "content": "go"}, use, {"role": "system", "content": "mid"},
                                 {"role": "user", "content": [result, {"type": "text", "text": "more"}]}]}
    assert post(good).status_code == 200
    assert post({**MSGS, "temperature": 1.01}).status_code == 400
    assert post({**MSGS, "temperature": 1.0}).status_code == 200
    count = _post(stack, info, "/v1/messages/count_tokens", json.dumps(no_max).encode())
    assert count.status_code == 200  # count_tokens takes no max_tokens


def test_openai_tool_pairing_matches_the_real_api(stack):
    info = stack.open()
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    base = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    ok = {"messages": base + [{"role": "tool", "tool_call_id": "call_1", "content": "1"}]}
    assert _post(stack, info, "/v1/chat/completions", json.dumps(ok).encode()).status_code == 200
    for messages, field in [(base + [{"role": "tool", "tool_call_id": "call_2", "content": "1"}],
                             "messages[2].tool_call_id"),
                            ([{"role": "tool", "tool_call_id": "call_1", "content": "1"}], "messages[0].role"),
                            (base + [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_1",
                                                                         "content": "1"}], "messages[3].role")]:
        r = _post(stack, info, "/v1/chat/completions", json.dumps({"messages": messages}).encode())
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    items = [{"type": "message", "role": "user", "content": "go"},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}]
    out = {"type": "function_call_output", "call_id": "call_1", "output": "1"}
    assert _post(stack, info, "/v1/responses", json.dumps({"input": items + [out]}).encode()).status_code == 200
    r = _post(stack, info, "/v1/responses", json.dumps({"input": items + [{**out, "call_id": "call_7"}]}).encode())
    assert r.status_code == 400 and "no tool call found for function call output with call_id 'call_7'" in r.text


def test_every_non_2xx_answer_is_logged_once(scripted, caplog):
    """A battery of failing requests: exactly one gateway log line each, naming method, path, status,
    session and reason; an in-stream engine failure too; successes log nothing."""
    replies = iter(["ok", ENGINE_ABORT + "partial"])
    stack = scripted(lambda prompt: next(replies, "ok"), token_delay_s=0.001)
    info = stack.open()
    other = stack.open()
    stack.loop.run(stack.gateway.finish_session(other.session_id, 0.0))
    cases = [
        ("/v1/chat/completions", info.token, json.dumps(CHAT).encode(), {}, 200),
        ("/v1/chat/completions", info.token, json.dumps({**CHAT, "stream": True}).encode(), {}, 200),  # in-stream
        ("/v1/chat/completions", "wrong", json.dumps(CHAT).encode(), {}, 401),
        ("/v1/messages", other.token, json.dumps(MSGS).encode(), {}, 409),
        ("/v1/nothing", info.token, b"{}", {}, 404),
        ("/v1/messages", info.token, json.dumps({**MSGS, "max_tokens": None}).encode(), {}, 400),
        ("/v1/chat/completions", info.token, json.dumps(CHAT).encode(), {"Content-Encoding": "gzip"}, 400),
        ("/v1/responses", info.token, b"{", {}, 400),
        ("/v1/chat/completions", info.token, json.dumps(CHAT).encode(), {"Content-Type": "application/json; charset=x"},
         415),
    ]
    with caplog.at_level(logging.INFO, logger="rayrl.gateway"):
        for path, token, content, headers, status in cases:
            caplog.clear()
            r = stack.http.post(stack.root + path, content=content, timeout=60,
                           headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json", **headers})
            assert r.status_code == status
            # the line is written before the answer is sent: it is there when the client has the answer
            lines = [rec.getMessage() for rec in caplog.records if rec.name == "rayrl.gateway"]
            in_stream = b'"stream": true' in content
            if status == 200 and not in_stream:
                assert lines == [], lines
                continue
            assert len(lines) == 1, (path, status, lines)
            shown = 500 if in_stream else status
            assert lines[0].startswith(f"POST {path} -> {shown}"), lines
            session = {info.token: info.session_id, other.token: other.session_id}.get(token, "-")
            if status in (401, 404, 409):  # refused before the session was known
                session = "-"
            assert f"session={session}" in lines[0] and lines[0].split(": ", 1)[1]


@pytest.mark.parametrize("raw", [
    b'{"a": 1, "a": 2}',  # the last of duplicate keys
    b'{"seed": 12345678901234567890123}', b'{"seed": -9223372036854775809}',  # integers beyond 64 bits
    b'{"seed": 9223372036854775807, "u": 18446744073709551615}',
    b'{"t": NaN, "u": Infinity, "v": -Infinity}', b'{"x": 1E400}', b'{"x": -0.0, "y": -0, "z": 1e-400}',
    b'{"x": 0.30000000000000004, "y": 1.0000000000000002}',
    b'\xef\xbb\xbf{"bom": true}', b'{"s": "\\ud83d\\ude00 \\u00e9 \\u0000"}', b'{"s": "a\x7fb"}',
    b'{"deep": ' + b'[' * 1100 + b']' * 1100 + b'}', b'{"deep": ' + b'[' * 900 + b']' * 900 + b'}',
    b'', b'  ', b'[1, 2]', b'null', b'{"a": 1}x', b'{"s": "a\nb"}', b'{"a": 01}', b'{"s": "\xff"}',
])
def test_the_fast_decoder_reads_what_the_standard_library_reads(raw):
    """Small UTF-8 bodies are parsed with orjson: every body gives the same object (types included) or the
    same 4xx message as the standard library's path (http_input.json_object)."""
    from rayrl.engines import http_input
    from rayrl.gateway.app import Gateway
    from rayrl.gateway.errors import RequestError

    try:
        want = ("ok", repr(http_input.json_object(raw, None)))
    except http_input.RequestError as err:
        want = ("error", str(err))
    try:
        got = ("ok", repr(Gateway._decode(raw, None)))
    except RequestError as err:
        got = ("error", err.message)
    assert got == want
