"""``tool_choice`` through all three APIs with the real SDKs (scripted engine, and the tiny model).

The scripted engine answers like a model that would rather not call a tool: with no forced start it
writes plain text, and when the prompt ends with the forced opening of a call it completes that call
(two calls, so that single-call limits show). So each choice is visible in what the engine saw (the
prompt's end) and what the client got back; the recorded turn keeps the forced text in its prompt
(never trained on) and the next turn still extends it token for token.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import numpy as np
import openai
import pytest

from rayrl.gateway.parsers import HermesToolParser, Llama3JsonToolParser, ThinkReasoningParser, parse_completion
from tests.gateway.scripted_engine import last_role

ANY_PREFIX = HermesToolParser().forced_prefix(None)
CALC_PREFIX = HermesToolParser().forced_prefix("calc")
PLAIN = "No tool needed: 4."
FINAL = "Done: 4 and 9."
SECOND_CALL = '\n<tool_call>\n{"name": "calc", "arguments": {"e": "5*5"}}\n</tool_call>'
CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate",
                                         "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}


def _generation_start(prompt: str) -> str:
    """What follows the last generation prompt: the forced start of the turn, if any."""
    return prompt[prompt.rfind("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]


def script(prompt: str) -> str:
    start = _generation_start(prompt)
    if start == CALC_PREFIX:
        return '{"e": "3*3"}}\n</tool_call>' + SECOND_CALL
    if start == ANY_PREFIX:
        return 'calc", "arguments": {"e": "2+2"}}\n</tool_call>' + SECOND_CALL
    if last_role(prompt) == "tool":
        return FINAL
    return PLAIN


@pytest.fixture
def stack(scripted):
    return scripted(script, token_delay_s=0.001)


def _chat(client, stream: bool, **kwargs):
    """(content, tool calls as dicts, finish_reason) of one Chat Completions call."""
    if not stream:
        out = client.chat.completions.create(model="m", **kwargs)
        calls = [c.model_dump() for c in out.choices[0].message.tool_calls or []]
        return out.choices[0].message.content or "", calls, out.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="m", stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            slot["id"] += tc.id or ""
            slot["function"]["name"] += tc.function.name or ""
            slot["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [c for _, c in sorted(calls.items())], finish


def _last_turn(stack, info):
    return stack.gateway.sessions.get(info.session_id).recent[-1]


def _args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tool_choice_values(stack, stream):
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    msgs = [{"role": "user", "content": "2+2?"}]
    tools = [CALC, CLOCK]

    content, calls, finish = _chat(client, stream, messages=msgs, tools=tools, tool_choice="auto")
    assert (content, calls, finish) == (PLAIN, [], "stop")  # auto: the model decides, and it did not call

    content, calls, finish = _chat(client, stream, messages=msgs, tools=tools, tool_choice="required")
    assert finish == "tool_calls" and content == ""
    assert _args(calls) == [("calc", {"e": "2+2"}), ("calc", {"e": "5*5"})]
    assert _generation_start(stack.engine.prompts[-1]) == ANY_PREFIX

    named = {"type": "function", "function": {"name": "calc"}}
    content, calls, finish = _chat(client, stream, messages=msgs, tools=tools, tool_choice=named)
    assert finish == "tool_calls" and _args(calls)[0] == ("calc", {"e": "3*3"})
    assert _generation_start(stack.engine.prompts[-1]) == CALC_PREFIX

    content, calls, finish = _chat(client, stream, messages=msgs, tools=tools, tool_choice="none")
    assert (content, calls, finish) == (PLAIN, [], "stop")
    assert "<tools>" not in stack.engine.prompts[-1]  # "none" hides the tools from the model


def test_forced_call_is_prompt_and_two_turns_fold_into_one_sample(stack):
    """The forced opening is part of the recorded prompt (mask 0), the model's tokens only are the
    response (mask 1), and the next turn, forced too, still extends the recorded tokens exactly: one
    sample, no drift."""
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    msgs = [{"role": "user", "content": "3*3?"}]
    first = client.chat.completions.create(model="m", messages=msgs, tools=[CALC],
                                           tool_choice={"type": "function", "function": {"name": "calc"}})
    turn = _last_turn(stack, info)
    forced_calc = stack.gateway.renderer.tokenize(CALC_PREFIX)
    forced_any = stack.gateway.renderer.tokenize(ANY_PREFIX)
    assert np.array_equal(turn.prompt_ids[-len(forced_calc):], forced_calc)
    response_text = stack.gateway.tokenizer.decode(turn.response_ids.tolist(), skip_special_tokens=True)
    assert response_text.startswith('{"e": "3*3"}}') and "<tool_call>" in response_text  # the second call
    calls = [c.model_dump() for c in first.choices[0].message.tool_calls]
    msgs += [{"role": "assistant", "content": None, "tool_calls": calls}]
    msgs += [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, ["9", "25"])]
    second = client.chat.completions.create(model="m", messages=msgs, tools=[CALC], tool_choice="required")
    assert second.choices[0].finish_reason == "tool_calls"
    second_turn = _last_turn(stack, info)
    assert np.array_equal(second_turn.prompt_ids[: len(turn.prompt_ids)], turn.prompt_ids)  # cumulative
    stats = stack.stats(info)
    assert stats["turns"] == 2 and stats["cumulative_hits"] == 1 and sum(stats["drift"].values()) == 0
    samples = stack.loop.run(stack.gateway.finish_session(info.session_id, 1.0))
    assert len(samples) == 1
    s = samples[0]
    assert s.prompt_length == len(turn.prompt_ids)
    assert np.array_equal(s.tokens[: s.prompt_length][-len(forced_calc):], forced_calc)
    # mask (aligned with tokens[prompt_length:]): turn 1's own tokens, the bridge ending in turn 2's
    # forced opening (context), turn 2's own tokens
    n1, n2 = len(turn.response_ids), len(second_turn.response_ids)
    bridge = len(s.loss_mask) - n1 - n2
    assert s.loss_mask[:n1].all() and not s.loss_mask[n1: n1 + bridge].any() and s.loss_mask[n1 + bridge:].all()
    bridge_tokens = s.tokens[s.prompt_length + n1: s.prompt_length + n1 + bridge]
    assert np.array_equal(bridge_tokens[-len(forced_any):], forced_any)
    assert np.array_equal(s.tokens[-n2:], second_turn.response_ids)
    assert np.all(s.rollout_logprobs[s.loss_mask == 1] == np.float32(-0.25))


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_stops_after_one_call(stack, stream):
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    msgs = [{"role": "user", "content": "2+2?"}]
    content, calls, finish = _chat(client, stream, messages=msgs, tools=[CALC], tool_choice="required",
                                   parallel_tool_calls=False)
    assert finish == "tool_calls" and _args(calls) == [("calc", {"e": "2+2"})]
    turn = _last_turn(stack, info)
    assert turn.finish_reason == "stop"
    # generation stopped on the call's closing tag: the second call was never generated
    assert "5*5" not in stack.gateway.tokenizer.decode(turn.response_ids.tolist())
    msgs += [{"role": "assistant", "content": None, "tool_calls": calls},
             {"role": "tool", "tool_call_id": calls[0]["id"], "content": "4"}]
    assert _chat(client, stream, messages=msgs, tools=[CALC])[0] == FINAL
    assert stack.stats(info)["cumulative_hits"] == 1
    assert len(stack.loop.run(stack.gateway.finish_session(info.session_id, 1.0))) == 1


def test_forced_call_the_model_does_not_complete_is_plain_text(scripted):
    """No parseable call under a forcing choice: a normal answer with the text, finish "stop"."""
    stack = scripted(lambda prompt: "I would rather not.")
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    for stream in (False, True):
        content, calls, finish = _chat(client, stream, messages=[{"role": "user", "content": "hi"}],
                                       tools=[CALC], tool_choice="required")
        assert (content, calls, finish) == (ANY_PREFIX + "I would rather not.", [], "stop")
    assert stack.gateway.counters["tool_choice_unmet"] == 2
    assert stack.gateway.counters["errors_internal"] == 0


@pytest.mark.parametrize("body,message", [
    ({"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [CALC], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": 3}}}, "tool_choice.function.name"),
    ({"tools": [CALC], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_chat_bad_tool_choice_is_400(stack, body, message):
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], **body)
    assert message in err.value.body["message"] and err.value.body["param"] in ("tool_choice", "parallel_tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_choice(stack, stream):
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    tools = [{"type": "function", "name": "calc", "parameters": CALC["function"]["parameters"]},
             {"type": "function", "name": "clock", "parameters": {"type": "object", "properties": {}}},
             {"type": "web_search"}]

    def call(**kwargs):
        if not stream:
            return client.responses.create(model="m", input="2+2?", tools=tools, **kwargs)
        with client.responses.stream(model="m", input="2+2?", tools=tools, **kwargs) as s:
            return s.get_final_response()

    assert call(tool_choice="auto").output_text == PLAIN
    out = call(tool_choice="required")
    assert [(i.name, json.loads(i.arguments)) for i in out.output] == [("calc", {"e": "2+2"}), ("calc", {"e": "5*5"})]
    out = call(tool_choice={"type": "function", "name": "calc"}, parallel_tool_calls=False)
    assert [(i.type, i.name, json.loads(i.arguments)) for i in out.output] == [("function_call", "calc", {"e": "3*3"})]
    assert call(tool_choice="none").output_text == PLAIN and "<tools>" not in stack.engine.prompts[-1]
    for bad, message in [({"type": "function", "name": "web_search"}, "not among the tools"),
                         ({"type": "web_search_preview"}, "not supported"), ("always", "tool_choice must be")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="m", input="hi", tools=tools, tool_choice=bad)
        assert message in err.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_choice(stack, stream):
    info = stack.open()
    client = anthropic.Anthropic(base_url=stack.root, api_key=info.token, max_retries=0)
    tools = [{"name": "calc", "description": "evaluate", "input_schema": CALC["function"]["parameters"]},
             {"name": "clock", "input_schema": {"type": "object", "properties": {}}}]

    def call(choice):
        kwargs = dict(model="claude-x", max_tokens=200, messages=[{"role": "user", "content": "2+2?"}],
                      tools=tools, tool_choice=choice)
        if not stream:
            return client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as s:
            return s.get_final_message()

    def uses(msg):
        return [(b.name, b.input) for b in msg.content if b.type == "tool_use"]

    auto = call({"type": "auto"})
    assert auto.stop_reason == "end_turn" and auto.content[0].text == PLAIN
    any_ = call({"type": "any"})
    assert any_.stop_reason == "tool_use" and uses(any_) == [("calc", {"e": "2+2"}), ("calc", {"e": "5*5"})]
    tool = call({"type": "tool", "name": "calc"})
    assert tool.stop_reason == "tool_use" and uses(tool)[0] == ("calc", {"e": "3*3"})
    single = call({"type": "any", "disable_parallel_tool_use": True})
    assert single.stop_reason == "tool_use" and uses(single) == [("calc", {"e": "2+2"})]
    none = call({"type": "none"})
    assert none.stop_reason == "end_turn" and "<tools>" not in stack.engine.prompts[-1]
    for bad, message in [({"type": "tool", "name": "nope"}, "'nope'"), ({"type": "tool"}, "tool_choice.name"),
                         ({"type": "sometimes"}, "tool_choice must be"),
                         ({"type": "auto", "disable_parallel_tool_use": "yes"}, "disable_parallel_tool_use")]:
        with pytest.raises(anthropic.BadRequestError) as err:
            call(bad)
        assert err.value.body["type"] == "error" and message in err.value.body["error"]["message"]


def test_tiny_model_under_forcing_choices_never_fails(tiny_stack):
    """A real (random) model almost never completes a forced call parseably: every API still answers
    200 with what it wrote, starting with the forced opening."""
    info = tiny_stack.open()
    unmet = tiny_stack.gateway.counters["tool_choice_unmet"]
    oa = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    out = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=[CALC],
                                     tool_choice="required", max_tokens=6)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    missed = choice.finish_reason != "tool_calls"
    if missed:
        assert choice.message.content.startswith(ANY_PREFIX)
    r = httpx.post(info.base_url + "/responses", headers={"Authorization": f"Bearer {info.token}"},
                   json={"input": "hi", "max_output_tokens": 6, "tool_choice": {"type": "function", "name": "calc"},
                         "tools": [{"type": "function", "name": "calc", "parameters": {"type": "object"}}]})
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete")
    output = r.json()["output"]
    missed += all(item["type"] != "function_call" for item in output)
    if output[0]["type"] == "message":
        assert output[0]["content"][0]["text"].startswith(CALC_PREFIX)
    an = anthropic.Anthropic(base_url=tiny_stack.root, api_key=info.token, max_retries=0)
    msg = an.messages.create(model="claude-x", max_tokens=6, messages=[{"role": "user", "content": "hi"}],
                             tools=[{"name": "calc", "input_schema": {"type": "object"}}],
                             tool_choice={"type": "any"})
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    missed += msg.stop_reason != "tool_use"
    assert tiny_stack.gateway.counters["tool_choice_unmet"] - unmet == missed
    assert tiny_stack.stats(info)["turns"] == 3


def test_forced_prefixes_of_each_family_parse_with_the_completion():
    hermes, llama = HermesToolParser(), Llama3JsonToolParser()
    out = parse_completion(hermes.forced_prefix("calc") + '{"e": "1"}}\n</tool_call>', hermes, None)
    assert _args(out.tool_calls) == [("calc", {"e": "1"})] and out.content == ""
    out = parse_completion(llama.forced_prefix(None) + 'calc", "parameters": {"e": "1"}}', llama, None)
    assert _args(out.tool_calls) == [("calc", {"e": "1"})]
    out = parse_completion(llama.forced_prefix('we"ird') + "{}}", llama, None)
    assert _args(out.tool_calls) == [('we"ird', {})]
    # a template whose generation prompt opens <think>: the forced text closes the reasoning first
    think = ThinkReasoningParser(opened_in_prompt=True)
    forced = think.close_tag + "\n\n" + hermes.forced_prefix(None)
    out = parse_completion(forced + 'calc", "arguments": {}}</tool_call>', hermes, think)
    assert out.reasoning == "" and _args(out.tool_calls) == [("calc", {})]
