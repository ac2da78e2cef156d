"""One session can never touch another: hostile requests next to an honest one, through the gateway.

The gateway refuses every sampling value outside what an engine holds with a 400 naming the field
(a seed of 2^64 used to pass and abort the engine's whole batch, truncating a concurrent session's
turn, which was then recorded as normal training data). Values at the edge of the ranges are served.
A greedy turn of another session, run while a stream of such requests goes on, gets exactly the tokens
it gets alone. A generation the engine fails or cuts is never recorded as a turn: the client gets an
error (a 5xx, or an in-stream error) and the session counts an infrastructure error
(``Gateway.session_stats``: ``infra_errors``, ``infra_error``).

Real parts: a CPU engine serving a tiny model with varied random weights (so greedy text varies token
to token) behind a real gateway, both on loopback; the scripted engine (a real HTTP server) where an
exact engine failure is needed.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rayrl.config import GatewayConfig, TrajectoryConfig
from rayrl.engines.router import Router
from rayrl.gateway.app import Gateway
from rayrl.gateway.event_loop import new_event_loop as gateway_loop  # the loop Ray hosts it on
from tests.engines._engine_kit import model_with_weights
from tests.gateway.scripted_engine import ENGINE_ABORT, ENGINE_FAILURE
from tests.gateway.stacks import Stack
from tests.loop_support import LoopThread

CHAT = {"messages": [{"role": "user", "content": "Tell me about the fox and the crow."}], "max_tokens": 6}
MSGS = {"model": "claude-x", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}
GREEDY = {"messages": [{"role": "user", "content": "Write a long story about a red fox."}], "max_tokens": 40,
          "temperature": 0}

# (path, body, the field a 400 must name; None = served)
HOSTILE = [
    ("/v1/chat/completions", {**CHAT, "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": -(2**63) - 1}, "seed"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2**31}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**30}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 1e6}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"1": None}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 1e308}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "temperature": 1e308}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 10**9}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "stop": ["x" * 5000]}, "stop"),
    ("/v1/messages", {**MSGS, "top_k": 2**40}, "top_k"),
    ("/v1/messages", {**MSGS, "top_k": 0}, "top_k"),
    ("/v1/messages", {**MSGS, "temperature": 1.5}, "temperature"),
    ("/v1/messages", {**MSGS, "max_tokens": 2**31}, "max_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2**40}, "max_output_tokens"),
    ("/v1/responses", {"input": "hi", "temperature": -1}, "temperature"),
    # the edges of every range: served
    ("/v1/chat/completions", {**CHAT, "seed": 2**63 - 1, "temperature": 2.0}, None),
    ("/v1/chat/completions", {**CHAT, "seed": -(2**63), "top_p": 1e-9}, None),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"0": 100, "1": -100, "2": 100.0}, "presence_penalty": 2,
                              "frequency_penalty": -2}, None),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 20, "logprobs": True, "stop": ["a"] * 16}, None),
    ("/v1/messages", {**MSGS, "top_k": 1, "temperature": 1.0}, None),
    ("/v1/messages", {**MSGS, "top_k": 2**31 - 1, "temperature": 0.0}, None),
]


@pytest.fixture(scope="module")
def varied_stack(tiny_model_dir, tmp_path_factory):
    """A gateway over a CPU engine serving the tiny model with varied weights (greedy text varies)."""
    from transformers import AutoTokenizer

    from rayrl.engines.cpu.engine import CPUEngine
    from rayrl.engines.cpu.server import EngineServer

    path = model_with_weights(tiny_model_dir, tmp_path_factory.mktemp("varied"), seed=5)
    loop = LoopThread(gateway_loop)
    engine = CPUEngine(path, dtype="float32", max_batch_size=16).start()
    server = EngineServer(engine)
    router = Router([loop.run(server.start())])
    gateway = Gateway(GatewayConfig(tool_parser="hermes"), TrajectoryConfig(), AutoTokenizer.from_pretrained(path),
                      router, model_name="tiny", context_length=engine.context_length)
    loop.run(gateway.start())
    yield Stack(loop, gateway, engine, router)
    loop.run(gateway.stop())
    loop.run(router.close())
    loop.run(server.stop())
    engine.shutdown()
    loop.close()


def _send(stack: Stack, token: str, path: str, body: dict) -> httpx.Response:
    return stack.http.post(stack.root + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=120)


def _greedy_turn(stack: Stack) -> tuple[list[int], str]:
    info = stack.open(role="honest")
    r = _send(stack, info.token, "/v1/chat/completions", GREEDY)
    assert r.status_code == 200, r.text
    turn = stack.gateway.sessions.get(info.session_id).recent[-1]
    stats = stack.gateway.session_stats(info.session_id)
    assert stats["turns"] == 1 and stats["infra_errors"] == 0 and turn.finish_reason == "length"
    return turn.response_ids.tolist(), r.json()["choices"][0]["message"]["content"]


def test_hostile_values_are_refused_naming_the_field_and_never_touch_another_session(varied_stack):
    alone = _greedy_turn(varied_stack)
    assert len(set(alone[0])) > 5  # varied text: a strong comparison
    attacker = varied_stack.open(role="attacker")
    stop = threading.Event()
    answers: list[tuple[str, dict, str | None, httpx.Response]] = []

    def attack() -> None:
        while not stop.is_set():
            for path, body, field in HOSTILE:
                answers.append((path, body, field, _send(varied_stack, attacker.token, path, body)))

    with ThreadPoolExecutor(6) as pool:
        attackers = [pool.submit(attack) for _ in range(3)]
        time.sleep(0.3)  # the stream is going
        together = [pool.submit(_greedy_turn, varied_stack) for _ in range(3)]
        results = [f.result(300) for f in together]
        stop.set()
        for f in attackers:
            f.result(300)
    assert all(result == alone for result in results)
    assert len(answers) >= len(HOSTILE)
    for path, body, field, resp in answers:
        if field is None:
            assert resp.status_code == 200, (path, body, resp.text)
            continue
        assert resp.status_code == 400, (path, body, resp.text)
        error = resp.json()["error"]
        assert field in error["message"], (field, error)
        if not path.startswith("/v1/messages"):
            assert error["param"] == field
    stats = varied_stack.gateway.session_stats(attacker.session_id)
    assert stats["infra_errors"] == 0 and stats["failed_requests"] == 0
    assert varied_stack.engine.stats()["last_error"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_the_engine_aborts_is_not_recorded(varied_stack, stream):
    """The engine aborts a running generation (as when it fails or is told to stop): the client gets an
    error instead of a truncated answer, and the session records no turn but an infrastructure error."""
    info = varied_stack.open()
    engine = varied_stack.engine

    def abort_when_running() -> None:
        deadline = time.monotonic() + 60
        while engine.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        engine.abort_all()

    killer = threading.Thread(target=abort_when_running)
    killer.start()
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3000, "stream": stream}
    r = _send(varied_stack, info.token, "/v1/chat/completions", body)
    killer.join()
    if stream:
        assert r.status_code == 200 and '"error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
        assert '"finish_reason": "stop"' not in r.text
    else:
        assert r.status_code == 503 and "aborted" in r.json()["error"]["message"]
    stats = varied_stack.gateway.session_stats(info.session_id)
    assert stats["turns"] == 0 and stats["infra_errors"] == 1 and stats["failed_requests"] == 1
    assert "aborted" in stats["infra_error"]


@pytest.mark.parametrize("path,body,stream_error", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, '"error"'),
    ("/v1/messages", {"max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}, "event: error"),
    ("/v1/responses", {"input": "hi"}, "response.failed"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_failures_count_as_infra_errors_in_every_api(scripted, path, body, stream_error, stream):
    """A request the engine fails alone (finish_reason abort with status_code, after some text) and an
    engine answering 500: 5xx (or an in-stream error after the partial text), nothing recorded, each
    call one infrastructure error, the first message kept; then a good call is recorded as usual."""
    replies = iter([ENGINE_ABORT + "partial text that must not count", ENGINE_FAILURE, "fine"])
    stack = scripted(lambda prompt: next(replies), token_delay_s=0.001)
    info = stack.open()
    for _ in range(2):
        r = _send(stack, info.token, path, {**body, "stream": stream})
        if stream:
            assert r.status_code == 200 and stream_error in r.text
        else:
            assert r.status_code in (500, 503), r.text
    stats = stack.gateway.session_stats(info.session_id)
    assert stats["turns"] == 0 and stats["infra_errors"] == 2 and stats["failed_requests"] == 2
    assert "scripted failure" in stats["infra_error"]  # the first one's message
    r = _send(stack, info.token, path, {**body, "stream": stream})
    assert r.status_code == 200 and stream_error not in r.text
    stats = stack.gateway.session_stats(info.session_id)
    assert stats["turns"] == 1 and stats["infra_errors"] == 2
