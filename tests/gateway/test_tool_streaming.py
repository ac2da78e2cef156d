"""Tool calls through all three APIs with the real SDKs, streaming and not (scripted engine).

The engine's answers are scripted (two tool calls in one completion, then a final answer once tool
output is in the prompt) so every wire detail can be checked exactly: incremental content deltas
before the tool-call marker, several tool calls in one stream, the echoed history hitting cumulative
token mode (the second prompt reuses the first turn's exact tokens) and one trajectory per session.
"""

from __future__ import annotations

import json

import anthropic
import numpy as np
import openai
import pytest

from tests.gateway.scripted_engine import last_role

TWO_CALLS = ('Let me compute both.\n<tool_call>{"name": "calc", "arguments": {"e": "1+1"}}</tool_call>\n'
             '<tool_call>{"name": "calc", "arguments": {"e": "2+2"}}</tool_call>')
FINAL = "The answers are 2 and 4."
CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate",
                                         "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}


def script(prompt: str) -> str:
    return FINAL if last_role(prompt) == "tool" else TWO_CALLS


@pytest.fixture
def stack(scripted):
    return scripted(script, token_delay_s=0.002)


def _samples(stack, info):
    return stack.loop.run(stack.gateway.finish_session(info.session_id, 1.0))


def _check_one_sample(stack, info, turns=2):
    stats = stack.stats(info)
    assert stats["turns"] == turns == stats["api_calls"]
    assert stats["cumulative_hits"] == turns - 1 and sum(stats["drift"].values()) == 0
    samples = _samples(stack, info)
    assert len(samples) == 1  # both turns in one token-faithful sample
    s = samples[0]
    assert np.all(s.rollout_logprobs[s.loss_mask == 1] == np.float32(-0.25))
    assert np.all(s.policy_versions[s.loss_mask == 1] == 3)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_two_tool_calls(stack, stream):
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    messages = [{"role": "system", "content": "You can call calc."}, {"role": "user", "content": "1+1 and 2+2?"}]
    if stream:
        content_deltas, calls, finish = [], {}, None
        for chunk in client.chat.completions.create(model="gpt-x", messages=messages, tools=[CALC], stream=True):
            delta = chunk.choices[0].delta
            if delta.content:
                content_deltas.append(delta.content)
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert len(content_deltas) > 3  # incremental, not one block at the end
        content = "".join(content_deltas)
        tool_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for _, c in sorted(calls.items())]
    else:
        out = client.chat.completions.create(model="gpt-x", messages=messages, tools=[CALC])
        finish, content = out.choices[0].finish_reason, out.choices[0].message.content
        tool_calls = [c.model_dump() for c in out.choices[0].message.tool_calls]
    assert finish == "tool_calls"
    assert content == "Let me compute both."  # held-back whitespace before the marker never went out
    assert [json.loads(c["function"]["arguments"]) for c in tool_calls] == [{"e": "1+1"}, {"e": "2+2"}]
    assert all(c["id"].startswith("call_") for c in tool_calls)
    messages.append({"role": "assistant", "content": content, "tool_calls": tool_calls})
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(tool_calls, ["2", "4"])]
    second = client.chat.completions.create(model="gpt-x", messages=messages, tools=[CALC], logprobs=True)
    assert second.choices[0].message.content == FINAL and second.choices[0].finish_reason == "stop"
    assert [t.logprob for t in second.choices[0].logprobs.content] == [-0.25] * second.usage.completion_tokens
    _check_one_sample(stack, info)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_calls_replayed_statelessly(stack, stream):
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    tools = [{"type": "function", "name": "calc", "parameters": CALC["function"]["parameters"]},
             {"type": "web_search"}, {"type": "namespace", "name": "multi_agent_v1", "tools": []}]
    inputs = [{"type": "message", "role": "developer",
               "content": [{"type": "input_text", "text": "You can call calc."}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "1+1 and 2+2?"}]}]
    if stream:
        with client.responses.stream(model="codex-x", input=inputs, tools=tools, store=False) as s:
            kinds = [ev.type for ev in s]
            response = s.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert kinds.count("response.output_text.delta") > 3
        assert kinds.count("response.function_call_arguments.delta") == 2
        assert kinds.count("response.function_call_arguments.done") == 2
        assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    else:
        response = client.responses.create(model="codex-x", input=inputs, tools=tools, store=False)
    assert response.status == "completed" and response.usage.output_tokens > 0
    message, *calls = response.output
    assert message.type == "message" and message.content[0].text == "Let me compute both."
    assert [(c.type, c.name, json.loads(c.arguments)) for c in calls] == [
        ("function_call", "calc", {"e": "1+1"}), ("function_call", "calc", {"e": "2+2"})]
    # Codex replays the whole input: the output items, a reasoning item it may add, the outputs
    replay = inputs + [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": message.content[0].text}]},
        *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls],
        *[{"type": "function_call_output", "call_id": c.call_id, "output": r} for c, r in zip(calls, ["2", "4"])],
    ]
    second = client.responses.create(model="codex-x", input=replay, tools=tools, store=False)
    assert second.output_text == FINAL
    _check_one_sample(stack, info)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_use_round_trip(stack, stream):
    info = stack.open()
    client = anthropic.Anthropic(base_url=stack.root, api_key=info.token, max_retries=0)
    tools = [{"name": "calc", "description": "evaluate", "input_schema": CALC["function"]["parameters"]},
             {"type": "web_search_20250305", "name": "web_search"}]
    messages = [{"role": "user", "content": "1+1 and 2+2?"}]
    kwargs = dict(model="claude-opus-4-8", max_tokens=256, system="You can call calc.", tools=tools,
                  thinking={"type": "adaptive"})
    if stream:
        with client.messages.stream(messages=messages, **kwargs) as s:
            kinds = [ev.type for ev in s]
            msg = s.get_final_message()
        assert "text" in kinds and kinds.count("input_json") == 2  # SDK names for the deltas
    else:
        msg = client.messages.create(messages=messages, **kwargs)
    assert msg.stop_reason == "tool_use"
    text, *uses = msg.content
    assert text.type == "text" and text.text == "Let me compute both."
    assert [(u.type, u.name, u.input) for u in uses] == [("tool_use", "calc", {"e": "1+1"}),
                                                         ("tool_use", "calc", {"e": "2+2"})]
    assert all(u.id.startswith("toolu_") for u in uses)
    messages.append({"role": "assistant", "content": [b.model_dump() for b in msg.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": u.id, "content": r, "is_error": False,
         "cache_control": {"type": "ephemeral"}} for u, r in zip(uses, ["2", "4"])]})
    second = client.messages.create(messages=messages, **kwargs)
    assert second.stop_reason == "end_turn" and second.content[0].text == FINAL
    _check_one_sample(stack, info)
