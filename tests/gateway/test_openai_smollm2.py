"""The gateway with the real `openai` SDK, a real CPU engine server and the real SmolLM2 model.

A multi-turn tool-use exchange goes through the gateway; every call is recorded token for token and
the session folds into one training sample with the tool output masked.
"""

from __future__ import annotations

import json

import aiohttp
import numpy as np
import openai
import pytest

from rayrl.agents.python_agent import DEFAULT_SYSTEM_PROMPT, PythonToolAgent
from rayrl.agents.toolbox import make_tools
from rayrl.config import GatewayConfig, TrajectoryConfig
from rayrl.engines.cpu.engine import CPUEngine
from rayrl.engines.cpu.server import EngineServer
from rayrl.engines.router import Router
from rayrl.gateway.app import Gateway


@pytest.fixture
def stack(loop_thread, smollm2_dir):
    """CPU engine server + gateway, both real HTTP servers on loopback."""
    from transformers import AutoTokenizer

    engine = CPUEngine(smollm2_dir, dtype="float32", max_batch_size=8, context_length=2048).start()
    server = EngineServer(engine)
    url = loop_thread.run(server.start())
    router = Router([url])
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = GatewayConfig(tool_parser="hermes", inject_tool_schemas=False)
    gateway = Gateway(cfg, TrajectoryConfig(), tokenizer, router, model_name="smollm2-135m-instruct",
                      context_length=2048)
    loop_thread.run(gateway.start())
    yield gateway, tokenizer
    loop_thread.run(gateway.stop())
    loop_thread.run(router.close())
    loop_thread.run(server.stop())
    engine.shutdown()


def _first_messages(question: str) -> list[dict]:
    tools = make_tools(["calculator"])
    demo = PythonToolAgent(few_shot_examples=2).demonstrations(tools)
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *demo, {"role": "user", "content": question}]


def test_openai_sdk_tool_call_round_trip(stack, loop_thread):
    gateway, tokenizer = stack
    tool_schema = [t.schema() for t in make_tools(["calculator"])]
    # at temperature 1 SmolLM2 writes a valid call about half the time: try a few seeds
    for seed in range(12):
        info = gateway.open_session({"test": True})
        client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
        messages = _first_messages("What is 56 + 41?")
        first = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=messages, tools=tool_schema, temperature=1.0,
            max_tokens=48, seed=seed,
        )
        if first.choices[0].message.tool_calls:
            break
        gateway.sessions.finish(info.session_id, 0.0)
    else:
        pytest.fail("no valid tool call in 12 seeded samples")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "calculator"
    json.loads(call.function.arguments)
    # the agent echoes the assistant message as the SDK gives it, then the tool output
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "97"})
    second = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, tools=tool_schema, temperature=1.0, max_tokens=32,
        seed=seed, logprobs=True,
    )
    assert second.choices[0].message.role == "assistant"
    assert len(second.choices[0].logprobs.content) == second.usage.completion_tokens
    assert gateway.counters["cumulative_hits"] >= 1  # history matched: the prompt reused exact tokens

    stats = gateway.session_stats(info.session_id)
    assert stats["turns"] == 2 and sum(stats["drift"].values()) == 0
    samples = loop_thread.run(gateway.finish_session(info.session_id, 1.0))
    assert len(samples) == 1  # both turns in one sample: the second prompt extends the first exactly
    s = samples[0]
    n_resp = len(s.tokens) - s.prompt_length
    assert len(s.loss_mask) == n_resp == len(s.rollout_logprobs) == len(s.policy_versions)
    assert s.loss_mask[0] == 1 and s.loss_mask.sum() == first.usage.completion_tokens + second.usage.completion_tokens
    # the tool output sits in the masked bridge
    bridge = s.tokens[s.prompt_length:][s.loss_mask == 0]
    assert "97" in tokenizer.decode(bridge.tolist())
    assert np.all(s.rollout_logprobs[s.loss_mask == 1] <= 0.0)
    assert np.all(s.rollout_logprobs[s.loss_mask == 0] == 0.0)

    # a finished session's token is refused with 409; an unknown token with 401
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    bad = openai.OpenAI(base_url=info.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_bad_requests_get_4xx_json(stack, loop_thread):
    gateway, _ = stack
    info = gateway.open_session()
    headers = {"Authorization": f"Bearer {info.token}"}
    url = info.base_url + "/chat/completions"

    async def post(data, hdrs=headers, raw=False):
        async with aiohttp.ClientSession() as s:
            kwargs = {"data": data} if raw else {"json": data}
            async with s.post(url, headers=hdrs, **kwargs) as r:
                return r.status, await r.json()

    cases = [
        (b"{not json", True, 400),
        (b"[1, 2]", True, 400),
        ({"messages": []}, False, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, False, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, False, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, False, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, False, 400),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, False, 400),
        ({"messages": [{"role": "user", "content": "x " * 5000}]}, False, 400),
    ]
    for data, raw, status in cases:
        code, body = loop_thread.run(post(data, raw=raw))
        assert code == status, (data, body)
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    code, body = loop_thread.run(post({"messages": [{"role": "user", "content": "hi"}]}, hdrs={}))
    assert code == 401 and "error" in body
    assert gateway.sessions.open_sessions >= 1  # nothing else was disturbed
