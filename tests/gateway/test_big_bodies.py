"""No request blocks the server: large bodies are decoded, rendered and tokenized off the event loop,
and a token limit stops a huge prompt early.

A 20 MB body used to keep the gateway's event loop busy for 42 s (it was tokenized in full, on the
loop): ``/health`` and every other session waited. Here the 20 MB body is sent over a raw socket, and
once the gateway works on it, ``/health`` and another session's small chat call must still be answered
(an order of events, not a timing: the big body's decoding is held until the others were served, which
only a gateway that works on it off the event loop can do; the measured latencies are printed, and
bench/gateway_soak.py reports them). The huge prompt is refused with the dialect's context-length
error, counted up to the limit only ("at least N tokens", N far below its full length).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from rayrl.config import GatewayConfig
from rayrl.gateway.parsers import HermesToolParser
from rayrl.gateway.render import CHUNK_CHARS, ChatRenderer, PromptTooLong

BIG_TEXT = "The quick brown fox jumps over the lazy dog. " * 450_000  # 20 MB, ~4.5M tokens


def _raw_post(port: int, path: str, token: str, body: bytes) -> tuple[int, dict]:
    """POST over a plain socket (the body in one ``sendall``, as a client that streams it would not wait)."""
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        sock.sendall(head.encode() + body)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    raw = b"".join(chunks)
    status = int(raw.split(b" ", 2)[1])
    return status, json.loads(raw.split(b"\r\n\r\n", 1)[1])


@pytest.mark.parametrize("shape", ["one 20 MB message", "300,000 small messages"])
def test_a_20mb_body_does_not_block_the_server(scripted, shape):
    stack = scripted(lambda prompt: "ok")
    attacker, bystander = stack.open(), stack.open()
    if shape == "one 20 MB message":
        messages = [{"role": "user", "content": BIG_TEXT}]
    else:
        messages = [{"role": "user", "content": f"message {i} with some words in it"} for i in range(300_000)]
        messages += [{"role": "user", "content": "x" * (20_000_000 - len(json.dumps(messages)))}]
    body = json.dumps({"messages": messages, "max_tokens": 4}).encode()
    assert len(body) >= 20_000_000
    port = int(stack.root.rsplit(":", 1)[1])
    answered, stop = threading.Event(), threading.Event()
    working, served = threading.Event(), threading.Event()  # the gateway is on the big body; the others were served
    health: list[tuple[bool, float]] = []  # (sent while the gateway worked on the body, latency)
    small: dict = {}
    decode = stack.gateway._decode

    def held_decode(raw: bytes, charset: str | None) -> dict:
        """The big body's decoding starts the others' calls and waits until they were served, so the test does
        not depend on how long the gateway takes over the body. Were the work on the event loop, this wait
        would hold the loop too, the small call could not be served, and the order asserted below would fail
        (after 60 s)."""
        if len(raw) >= 20_000_000:
            working.set()
            served.wait(60)
        return decode(raw, charset)

    stack.gateway._decode = held_decode

    def poll_health() -> None:  # polls from before the body is sent until after it is answered
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                inside = working.is_set()
                started = time.perf_counter()
                assert client.get(stack.root + "/health").status_code == 200
                health.append((inside and not answered.is_set(), time.perf_counter() - started))
                time.sleep(0.002)

    def small_turn() -> None:  # another session's turn, sent once the gateway works on the big body
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {bystander.token}"}) as client:
            turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert client.post(stack.root + "/v1/chat/completions", json=turn).status_code == 200  # warm
            working.wait(300)
            r = client.post(stack.root + "/v1/chat/completions", json={**turn, "messages": turn["messages"] * 2})
            small.update(status=r.status_code, before_big=not answered.is_set())
            end = time.monotonic() + 60
            while sum(inside for inside, _ in health) < 2 and time.monotonic() < end:
                time.sleep(0.01)
            served.set()

    helpers = [threading.Thread(target=poll_health), threading.Thread(target=small_turn)]
    for thread in helpers:
        thread.start()
    time.sleep(0.2)  # the poller is going
    status, error = _raw_post(port, "/v1/chat/completions", attacker.token, body)
    answered.set()
    time.sleep(0.05)
    stop.set()
    for thread in helpers:
        thread.join(120)
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    assert "at least" in error["error"]["message"] and error["error"]["param"] == "messages"
    during = sorted(latency for inside, latency in health if inside)
    # order of events, not timings: /health and another session's call answered while the body was processed
    assert len(during) >= 2 and small == {"status": 200, "before_big": True}, (len(during), small)
    print(f"{shape}: /health answered {len(during)} times while the body was processed; "
          f"p50 {during[len(during) // 2] * 1e3:.1f} ms, p99 {during[int(len(during) * 0.99)] * 1e3:.1f} ms, "
          f"max {during[-1] * 1e3:.1f} ms")
    assert stack.stats(bystander)["turns"] == 2 and stack.stats(attacker)["turns"] == 0
    assert stack.gateway.counters["errors_internal"] == 0


def test_a_huge_prompt_is_refused_after_counting_only_part_of_it(scripted):
    stack = scripted(lambda prompt: "ok", context_length=8192)
    info = stack.open()
    text = BIG_TEXT[:2_000_000]
    full = len(stack.gateway.renderer.tokenize(text))
    hdr = {"Authorization": f"Bearer {info.token}", "x-api-key": info.token}
    r = stack.http.post(stack.root + "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]},
                   headers=hdr, timeout=120)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("This model's maximum context length is 8192 tokens. However, your messages resulted "
                              "in at least ")
    at_least = int(message.split("at least ")[1].split()[0])
    assert 8192 < at_least < full // 10  # the rest of the text was never tokenized
    r = stack.http.post(stack.root + "/v1/messages", headers=hdr, timeout=120,
                   json={"max_tokens": 4, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt is too long: at least ")
    assert r.json()["error"]["message"].endswith(" tokens > 8192 maximum")
    r = stack.http.post(stack.root + "/v1/messages/count_tokens", headers=hdr, timeout=120,
                   json={"messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400 and "prompt is too long" in r.text
    r = stack.http.post(stack.root + "/v1/responses", headers=hdr, timeout=120, json={"input": text})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_a_prompt_that_does_not_fit_gets_the_numbers_in_each_dialect(scripted):
    stack = scripted(lambda prompt: "ok", context_length=64)
    info = stack.open()
    hdr = {"Authorization": f"Bearer {info.token}"}
    long = {"role": "user", "content": "word " * 100}
    r = stack.http.post(stack.root + "/v1/chat/completions", json={"messages": [long]}, headers=hdr)
    n = len(stack.gateway.renderer.render([long], None))
    assert r.status_code == 400 and r.json()["error"] == {
        "message": f"This model's maximum context length is 64 tokens. However, your messages resulted in {n} tokens. "
                   "Please reduce the length of the messages.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}
    r = stack.http.post(stack.root + "/v1/messages", json={"max_tokens": 8, "messages": [long]}, headers=hdr)
    assert r.json()["error"] == {"type": "invalid_request_error",
                                 "message": f"prompt is too long: {n} tokens > 64 maximum"}


def test_max_prompt_tokens_limits_prompts_below_the_context(scripted):
    stack = scripted(lambda prompt: "ok", cfg=GatewayConfig(tool_parser="hermes", max_prompt_tokens=40))
    info = stack.open()
    hdr = {"Authorization": f"Bearer {info.token}"}
    short = {"messages": [{"role": "user", "content": "hi"}]}
    assert stack.http.post(stack.root + "/v1/chat/completions", json=short, headers=hdr).status_code == 200
    r = stack.http.post(stack.root + "/v1/chat/completions", headers=hdr,
                   json={"messages": [{"role": "user", "content": "word " * 60}]})
    assert r.status_code == 400 and "gateway.max_prompt_tokens" in r.json()["error"]["message"]
    assert "is 40 tokens" in r.json()["error"]["message"]


def test_max_prompt_tokens_is_validated():
    from rayrl.config import ConfigError

    with pytest.raises(ConfigError, match="gateway.max_prompt_tokens"):
        GatewayConfig(max_prompt_tokens=-1)


def test_limited_tokenization_gives_the_same_ids_when_the_text_fits(tiny_model_dir):
    """Counting chunk by chunk against a limit is only a check: a text that fits gets exactly the ids
    of tokenizing it whole; one that does not is refused with a lower bound of its length."""
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir), HermesToolParser())
    text = ("Some words,\nsome numbers 12345 and symbols <|im_start|> :) " * 20_000)[: 5 * CHUNK_CHARS + 17]
    whole = renderer.tokenize(text)
    assert renderer.tokenize(text, limit=len(whole)).tolist() == whole.tolist()
    with pytest.raises(PromptTooLong) as err:
        renderer.tokenize(text, limit=len(whole) // 3)
    assert len(whole) // 3 < err.value.at_least <= len(whole)
