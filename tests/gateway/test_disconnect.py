"""A client that goes away aborts its engine request (real CPU engine, tiny model).

Each case asks for 3000 tokens, then drops the connection early: mid-stream for each streaming API,
and by timing out for a non-streaming call. The engine must stop generating for it (its running and
waiting queues drain long before 3000 tokens exist), nothing is recorded for the abandoned turn, and
the session keeps working.
"""

from __future__ import annotations

import time

import httpx
import pytest

MAX = 3000


def _wait_idle(engine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["running"] == 0 and s["waiting"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {engine.stats()}")


def _requests(info, root):
    bearer = {"Authorization": f"Bearer {info.token}"}
    return {
        "chat": (info.base_url + "/chat/completions", bearer,
                 {"messages": [{"role": "user", "content": "go"}], "max_tokens": MAX, "stream": True}),
        "responses": (info.base_url + "/responses", bearer, {"input": "go", "max_output_tokens": MAX, "stream": True}),
        "messages": (root + "/v1/messages", {"x-api-key": info.token},
                     {"messages": [{"role": "user", "content": "go"}], "max_tokens": MAX, "stream": True}),
    }


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_stream_disconnect_aborts_engine_request(tiny_stack, api):
    engine, gateway = tiny_stack.engine, tiny_stack.gateway
    _wait_idle(engine)
    info = tiny_stack.open()
    url, headers, body = _requests(info, tiny_stack.root)[api]
    before = engine.stats()["tokens_generated"]
    disconnects = gateway.counters["client_disconnects"]
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            seen += ("delta" in line)
            if seen >= 3:
                break  # leave with the generation under way
    _wait_idle(engine)
    generated = engine.stats()["tokens_generated"] - before
    assert 0 < generated < MAX // 2, generated
    deadline = time.monotonic() + 5
    while gateway.counters["client_disconnects"] == disconnects and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gateway.counters["client_disconnects"] > disconnects
    assert tiny_stack.stats(info)["turns"] == 0  # the abandoned turn is not recorded
    ok = httpx.post(info.base_url + "/chat/completions", headers={"Authorization": f"Bearer {info.token}"},
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200 and tiny_stack.stats(info)["turns"] == 1


def test_non_streaming_disconnect_aborts_engine_request(tiny_stack):
    engine = tiny_stack.engine
    _wait_idle(engine)
    info = tiny_stack.open()
    before = engine.stats()["tokens_generated"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(info.base_url + "/chat/completions", headers={"Authorization": f"Bearer {info.token}"},
                   json={"messages": [{"role": "user", "content": "go"}], "max_tokens": MAX}, timeout=1.5)
    _wait_idle(engine)
    generated = engine.stats()["tokens_generated"] - before
    assert 0 < generated < MAX // 2, generated
    assert tiny_stack.stats(info)["turns"] == 0
