"""The front door (rayrl/gateway/front_door.py): ``/health`` is answered in a thread of its own, ahead of
everything the event loop is doing, and still says when the gateway cannot serve; every other request
is handed to the event loop whole.

The event loop is held here by a callback that waits on a threading.Event, as a loop iteration busy
with a thousand calls would hold it: ``/health`` answers while it is held, an LLM call waits. Orders of
events, not timings (bench/gateway_soak.py measures the latencies with 1,000 sessions).
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest

from rayrl.gateway.front_door import _health_request

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


class HeldLoop:
    """Holds the stack's event loop in one callback until released."""

    def __init__(self, stack) -> None:
        self.running, self.release = threading.Event(), threading.Event()

        def hold() -> None:
            self.running.set()
            self.release.wait(60)

        stack.loop.loop.call_soon_threadsafe(hold)
        assert self.running.wait(10)

    def __enter__(self) -> "HeldLoop":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()


def _chat(info) -> int:
    return httpx.post(f"{info.base_url}/chat/completions", json=CHAT, timeout=60,
                      headers={"Authorization": f"Bearer {info.token}"}).status_code


def test_health_is_answered_while_the_event_loop_is_held(scripted):
    stack = scripted(lambda prompt: "Noted.")
    info = stack.open()
    with HeldLoop(stack) as held, concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(_chat, info)
        health = httpx.get(stack.root + "/health", timeout=10)
        head = httpx.head(stack.root + "/", timeout=10)
        assert not held.release.is_set() and not call.done()  # answered while the loop was held
        assert health.status_code == 200 and head.status_code == 200 and head.content == b""
        body = health.json()
        assert body["status"] == "ok" and body["open_sessions"] == 1 and body["loop_lag_ms"] >= 0
        held.release.set()
        assert call.result(60) == 200  # the call waited for the loop, then was served
    assert stack.stats(info)["turns"] == 1
    assert stack.gateway.front.answered >= 2


def test_health_says_unavailable_while_the_loop_is_stalled(scripted):
    stack = scripted(lambda prompt: "Noted.")
    stack.gateway.front.stalled_s = 0.3
    with HeldLoop(stack):
        deadline = time.monotonic() + 20
        while (r := httpx.get(stack.root + "/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "never reported the stalled loop"
            time.sleep(0.1)
        assert r.status_code == 503
        assert r.json()["status"] == "unavailable" and "event loop has not run" in r.json()["reason"]
    deadline = time.monotonic() + 20
    while (r := httpx.get(stack.root + "/health", timeout=10)).status_code != 200:
        assert time.monotonic() < deadline, "never recovered once the loop ran again"
        time.sleep(0.1)


def test_a_keep_alive_connection_moves_to_the_loop_with_its_first_other_request(scripted):
    stack = scripted(lambda prompt: "Noted.")
    info = stack.open()
    handed = stack.gateway.front.handed_over
    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {info.token}"}) as client:
        assert client.get(stack.root + "/health").json()["status"] == "ok"  # answered by the front door
        r = client.post(f"{info.base_url}/chat/completions", json=CHAT)  # same connection, to the loop
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Noted."
        after = client.get(stack.root + "/health")  # now aiohttp's route answers: the same answer
        assert after.status_code == 200
        assert after.json()["status"] == "ok" and after.json()["open_sessions"] == 1 and "loop_lag_ms" in after.json()
    assert stack.gateway.front.handed_over == handed + 1


def _raw(root: str, *pieces: bytes) -> bytes:
    host, port = root[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.05)
        out = b""
        while b"\r\n\r\n" not in out or not out.endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            out += data
        return out


def test_requests_the_front_door_does_not_answer_are_served_whole(scripted):
    stack = scripted(lambda prompt: "Noted.")
    # a request line split over two reads: handed over, aiohttp reads it from its first byte
    split = _raw(stack.root, b"GET /hea", b"lth HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert split.startswith(b"HTTP/1.1 200") and json.loads(split.split(b"\r\n\r\n", 1)[1])["status"] == "ok"
    # a health path with a body, and an unknown path: the loop answers (404 is aiohttp's, as before)
    with_body = _raw(stack.root, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    assert with_body.startswith(b"HTTP/1.1 200")
    missing = httpx.get(stack.root + "/healthz", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()


@pytest.mark.parametrize("head, expected", [
    (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", (False, False)),
    (b"HEAD / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", (True, True)),
    (b"GET /health HTTP/1.0\r\n\r\n", (False, True)),
    (b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", (False, False)),
    (b"GET /health HTTP/1.1\r\nContent-Length: 0\r\n\r\n", (False, False)),
    (b"GET /health HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", None),
    (b"GET /health HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", None),
    (b"GET /health?x=1 HTTP/1.1\r\n\r\n", None),
    (b"POST /health HTTP/1.1\r\n\r\n", None),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n", None),  # the head has not all arrived
    (b"POST /v1/chat/completions HTTP/1.1\r\n\r\n", None),
])
def test_which_requests_the_front_door_answers(head, expected):
    assert _health_request(head) == expected
