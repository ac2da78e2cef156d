"""The lean front (rayrl/gateway/lean_front.py): LLM calls answered without aiohttp's web layer, everything
else handed to aiohttp's server at the first byte of the request that needs it, on the same connection.

Raw sockets, so the bytes on the wire are what is checked: pipelined requests answered in order across the
hand-over, aiohttp's own answer to a request its parser refuses, a body that arrives in pieces, a request that
asks to close. Each answer is compared with what aiohttp's server alone gives for the same bytes (a
connection whose first request is not an LLM call is aiohttp's from its first byte).
"""

from __future__ import annotations

import inspect
import json
import socket
import time

from aiohttp.web_protocol import MAX_MSG_QUEUE_SIZE, RequestHandler

from rayrl.gateway import lean_front

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def _conn(stack) -> socket.socket:
    host, port = stack.root[len("http://"):].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _chat_request(token: str, extra: bytes = b"", body: dict | None = None) -> bytes:
    data = json.dumps(body or CHAT).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer " + token.encode()
            + b"\r\nContent-Type: application/json\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(data) + data)


def _framed(sock: socket.socket, count: int) -> list[tuple[list[str], bytes]]:
    """``count`` HTTP/1.x answers read off ``sock``, Content-Length framed: (head lines, body)."""
    buf, out = b"", []
    while len(out) < count:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            lines = buf[:end].decode().split("\r\n")
            length = int(next(line.split(":", 1)[1] for line in lines if line.lower().startswith("content-length:")))
            if len(buf) >= end + 4 + length:
                out.append((lines, buf[end + 4:end + 4 + length]))
                buf = buf[end + 4 + length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed after {len(out)} answers"
        buf += chunk
    return out


def _answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """``count`` answers read off ``sock``: (status, body)."""
    return [(int(lines[0].split(" ", 2)[1]), body) for lines, body in _framed(sock, count)]


def test_llm_calls_stay_on_the_lean_front_and_others_go_to_aiohttp_in_order(scripted):
    stack = scripted(lambda prompt: "Noted.")
    info = stack.open()
    with _conn(stack) as sock:
        sock.sendall(_chat_request(info.token) + _chat_request(info.token))
        assert [status for status, _ in _answers(sock, 2)] == [200, 200]
        assert len(stack.gateway._lean) == 1  # served by the lean front, not handed over
        # pipelined: an LLM call, a route only aiohttp's app has, then an LLM call again (after the hand-over)
        sock.sendall(_chat_request(info.token) + b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
                     + _chat_request(info.token))
        answers = _answers(sock, 3)
        assert [status for status, _ in answers] == [200, 200, 200]
        assert json.loads(answers[0][1])["object"] == "chat.completion"
        assert json.loads(answers[1][1])["object"] == "list"
        assert json.loads(answers[2][1])["object"] == "chat.completion"
        assert not stack.gateway._lean  # aiohttp's server has it now
    assert stack.gateway.sessions.get(info.session_id).api_calls == 4


def test_a_refused_request_gets_aiohttps_own_answer(scripted):
    stack = scripted(lambda prompt: "Noted.")
    info = stack.open()
    garbage = b"BREW /coffee HTCPCP/1.0\r\n\r\n"
    with _conn(stack) as sock:  # aiohttp's server from the first byte: its answer to these bytes
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert _answers(sock, 1)[0][0] == 200
        sock.sendall(garbage)
        expected = _answers(sock, 1)[0]
    with _conn(stack) as sock:  # the lean front first, then the same bytes
        sock.sendall(_chat_request(info.token))
        assert _answers(sock, 1)[0][0] == 200
        sock.sendall(garbage)
        assert _answers(sock, 1)[0] == expected
    assert expected[0] == 400


def test_a_body_in_pieces_and_a_request_to_close(scripted):
    stack = scripted(lambda prompt: "Noted.")
    info = stack.open()
    request = _chat_request(info.token, extra=b"Connection: close\r\n")
    with _conn(stack) as sock:
        for piece in (request[:30], request[30:-10], request[-10:]):
            sock.sendall(piece)
            time.sleep(0.05)
        (status, body), = _answers(sock, 1)
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "Noted."
        assert sock.recv(1) == b""  # closed after the answer, as asked
    request = _chat_request(info.token)
    with _conn(stack) as sock:  # the rest of a body and the next request in one read: both answered
        sock.sendall(request[:-10])
        time.sleep(0.05)
        sock.sendall(request[-10:] + request)
        assert [status for status, _ in _answers(sock, 2)] == [200, 200]
        assert len(stack.gateway._lean) == 1  # not handed over: the second request was read from its first byte


def test_a_small_call_starts_once_its_body_is_all_in(scripted):
    """Head and body in two writes (as aiohttp's and httpx's clients send them): the call does not start on
    the head alone (it would only stop at reading the body), but once the body has come, and is answered."""
    stack = scripted(lambda prompt: "Noted.")
    info = stack.open()
    request = _chat_request(info.token)
    head_end = request.index(b"\r\n\r\n") + 4
    with _conn(stack) as sock:
        sock.sendall(request[:head_end])
        time.sleep(0.2)
        assert stack.gateway.counters["requests"] == 0  # the handler has not started
        sock.sendall(request[head_end:-1])
        time.sleep(0.1)
        assert stack.gateway.counters["requests"] == 0
        sock.sendall(request[-1:])
        (status, body), = _answers(sock, 1)
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "Noted."
        assert stack.gateway.counters["requests"] == 1
        sock.sendall(request)  # the connection goes on, from the next request's first byte
        assert _answers(sock, 1)[0][0] == 200
        assert len(stack.gateway._lean) == 1


def _heads(sock: socket.socket, count: int) -> list[list[str]]:
    """The status line and header lines of ``count`` answers, ``Date`` left out."""
    return [[line for line in lines if not line.startswith("Date: ")] for lines, _ in _framed(sock, count)]


def test_answers_have_aiohttps_own_heads(scripted):
    """The lean front writes a JSON answer's head itself (lean_front.plain_head): the same status line and
    headers, in the same order, as aiohttp's server writes for the same calls (an answer, an error, a call
    that asks to close)."""
    stack = scripted(lambda prompt: "Noted.")
    info = stack.open()
    calls = _chat_request(info.token) + _chat_request("not-a-token")
    closing = _chat_request(info.token, extra=b"Connection: close\r\n")
    with _conn(stack) as sock:
        sock.sendall(calls)
        lean = _heads(sock, 2)
        assert len(stack.gateway._lean) == 1  # the lean front answered them
        sock.sendall(closing)
        lean += _heads(sock, 1)
    with _conn(stack) as sock:  # aiohttp's server from the first byte
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n" + calls + closing)
        theirs = _heads(sock, 4)[1:]
        assert not stack.gateway._lean
    assert [head[0] for head in lean] == ["HTTP/1.1 200 OK", "HTTP/1.1 401 Unauthorized", "HTTP/1.1 200 OK"]
    assert lean == theirs
    assert any(line == "Connection: close" for line in lean[2]) and any(line.startswith("Server: ") for line in lean[0])


def test_calls_aiohttps_server_must_read_are_handed_over(scripted):
    """A chunked body and a query string: aiohttp's server answers them, the same as on its own."""
    stack = scripted(lambda prompt: "Noted.")
    info = stack.open()
    data = json.dumps(CHAT).encode()
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer " + info.token.encode()
               + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n" % len(data) + data + b"\r\n0\r\n\r\n")
    with _conn(stack) as sock:
        sock.sendall(_chat_request(info.token) + chunked)
        assert [status for status, _ in _answers(sock, 2)] == [200, 200]
        assert not stack.gateway._lean
    with _conn(stack) as sock:
        sock.sendall(_chat_request(info.token).replace(b"/v1/chat/completions", b"/v1/chat/completions?x=1", 1))
        (status, body), = _answers(sock, 1)
        assert status == 200 and json.loads(body)["object"] == "chat.completion"


def test_a_call_cancelled_by_its_session_finishing_closes_its_connection(scripted):
    """As aiohttp's server does: the client is not left waiting for an answer that will never come."""
    # five seconds a token: the answer cannot come before the session is finished, however loaded the machine
    stack = scripted(lambda prompt: "a slow answer " * 20, token_delay_s=5.0)
    info = stack.open()
    session = stack.gateway.sessions.get(info.session_id)
    with _conn(stack) as sock:
        sock.settimeout(10)
        sock.sendall(_chat_request(info.token))
        deadline = time.monotonic() + 10
        while not session.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert session.in_flight
        stack.loop.run(stack.gateway.finish_session(info.session_id, 0.0))
        assert sock.recv(65536) == b""  # closed, no answer
    assert not stack.gateway._lean


def test_the_parser_limits_and_timeouts_are_aiohttps_own():
    """The lean front reads requests with the limits aiohttp's server would use (the gateway changes none)."""
    defaults = {name: p.default for name, p in inspect.signature(RequestHandler.__init__).parameters.items()}
    assert (lean_front.MAX_LINE_SIZE, lean_front.MAX_HEADERS, lean_front.MAX_FIELD_SIZE, lean_front.READ_BUFSIZE,
            lean_front.KEEPALIVE_S, lean_front.LINGER_S) == (
        defaults["max_line_size"], defaults["max_headers"], defaults["max_field_size"], defaults["read_bufsize"],
        defaults["keepalive_timeout"], defaults["lingering_time"])
    assert lean_front.MAX_QUEUED == MAX_MSG_QUEUE_SIZE  # pipelined requests queued before reading pauses


def test_an_aiohttp_it_was_not_checked_on_gets_every_connection(scripted, monkeypatch):
    """The lean front builds on aiohttp's internal classes: on a release it was not checked on, aiohttp's
    server serves every connection, LLM calls included, as it did before the lean front."""
    from rayrl.gateway import app

    monkeypatch.setattr(lean_front.aiohttp, "__version__", "3.99.0")
    assert lean_front.fits_installed_aiohttp() is False
    monkeypatch.setattr(app, "LEAN_FRONT", lean_front.fits_installed_aiohttp())
    stack = scripted(lambda prompt: "Noted.")
    info = stack.open()
    with _conn(stack) as sock:
        sock.sendall(_chat_request(info.token) + _chat_request(info.token))
        answers = _answers(sock, 2)
        assert [status for status, _ in answers] == [200, 200]
        assert json.loads(answers[1][1])["choices"][0]["message"]["content"] == "Noted."
        assert not stack.gateway._lean
    monkeypatch.setattr(lean_front.aiohttp, "__version__", "3.14.5")
    assert lean_front.fits_installed_aiohttp() is True
