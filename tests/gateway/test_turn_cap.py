"""``gateway.max_turns_per_session``: the call after the cap gets a 400 in the caller's API dialect, counted,
before any byte is streamed; other sessions are untouched. Real gateway, scripted engine, real HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest

from rayrl.config import ConfigError, GatewayConfig, load_config


def _answer(prompt: str) -> str:
    return "ok"


def test_turn_cap_refuses_the_next_call_in_each_dialect(scripted):
    stack = scripted(_answer, cfg=GatewayConfig(tool_parser="hermes", max_turns_per_session=2))
    capped, other = stack.open(), stack.open()
    client = openai.OpenAI(base_url=capped.base_url, api_key=capped.token, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        assert client.chat.completions.create(model="m", messages=messages).choices[0].message.content == "ok"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=messages)
    error = refused.value.body
    assert error["code"] == "turn_limit_exceeded" and "gateway.max_turns_per_session" in error["message"]
    assert error["type"] == "invalid_request_error"

    hdr = {"Authorization": f"Bearer {capped.token}"}
    stream = httpx.post(stack.root + "/v1/chat/completions", headers=hdr,
                        json={"model": "m", "messages": messages, "stream": True})
    assert stream.status_code == 400 and stream.json()["error"]["code"] == "turn_limit_exceeded"  # not in-stream
    anthropic = httpx.post(stack.root + "/v1/messages", headers=hdr,
                           json={"model": "m", "max_tokens": 8, "messages": messages})
    assert anthropic.status_code == 400
    assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "invalid_request_error"
    assert "max_turns_per_session" in anthropic.json()["error"]["message"]
    responses = httpx.post(stack.root + "/v1/responses", headers=hdr, json={"model": "m", "input": "hi"})
    assert responses.status_code == 400 and responses.json()["error"]["code"] == "turn_limit_exceeded"

    stats = stack.gateway.session_stats(capped.session_id)
    assert stats["turns"] == 2 and stats["turn_cap_refusals"] == 4
    assert stack.gateway.counters["turn_cap_refusals"] == 4
    assert len(stack.engine.prompts) == 2  # refused calls never reached the engine

    # another session has its own turns
    bystander = openai.OpenAI(base_url=other.base_url, api_key=other.token, max_retries=0)
    assert bystander.chat.completions.create(model="m", messages=messages).choices[0].message.content == "ok"
    assert stack.gateway.session_stats(other.session_id)["turn_cap_refusals"] == 0
    samples = stack.loop.run(stack.gateway.finish_session(capped.session_id, 1.0))
    assert len(samples) == 2  # both recorded turns train (two retries of the same prompt: two leaves)


def test_no_cap_by_default_and_bad_values_fail_at_load():
    assert GatewayConfig().max_turns_per_session == 0
    with pytest.raises(ConfigError, match="gateway.max_turns_per_session"):
        load_config(None, ["gateway.max_turns_per_session=-1"])
