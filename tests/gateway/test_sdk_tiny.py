"""The three APIs with the real `openai` and `anthropic` SDKs against the real CPU engine (tiny model).

Multi-turn text conversations, streaming and not: the streamed text equals what is recorded, the
second turn's prompt extends the first turn's tokens exactly (cumulative token mode), and because
all APIs share one canonical message shape, a conversation can even switch API mid-session and still
fold into a single token-faithful sample.
"""

from __future__ import annotations

import anthropic
import numpy as np
import openai
import pytest


def _chat(client, messages, stream):
    if not stream:
        out = client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0.7)
        return out.choices[0].message.content, out.usage.completion_tokens
    parts, usage = [], None
    for chunk in client.chat.completions.create(model="any", messages=messages, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return "".join(parts), usage.completion_tokens


def _responses(client, messages, stream):
    items = [{"type": "message", "role": m["role"] if m["role"] != "system" else "developer",
              "content": [{"type": "input_text" if m["role"] != "assistant" else "output_text", "text": m["content"]}]}
             for m in messages]
    if not stream:
        out = client.responses.create(model="any", input=items, max_output_tokens=12)
    else:
        # random text usually runs into max_output_tokens: the stream then ends with
        # response.incomplete (the SDK's get_final_response() accepts only response.completed)
        events = list(client.responses.create(model="any", input=items, max_output_tokens=12, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")
        out = events[-1].response
        assert (out.status == "incomplete") == (out.incomplete_details is not None)
    return out.output_text, out.usage.output_tokens


def _anthropic(client, messages, stream):
    system = messages[0]["content"]
    kwargs = dict(model="claude-opus-4-8", max_tokens=12, system=system, messages=messages[1:])
    if not stream:
        out = client.messages.create(**kwargs)
    else:
        with client.messages.stream(**kwargs) as s:
            out = s.get_final_message()
    return out.content[0].text, out.usage.output_tokens


CALLERS = {"chat": _chat, "responses": _responses, "anthropic": _anthropic}


def _clients(stack, info):
    return {"chat": openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0),
            "responses": openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0),
            "anthropic": anthropic.Anthropic(base_url=stack.root, api_key=info.token, max_retries=0)}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("apis", [("chat", "chat"), ("responses", "responses"), ("anthropic", "anthropic"),
                                  ("chat", "anthropic"), ("anthropic", "responses")])
def test_two_turns_one_sample(tiny_stack, apis, stream):
    info = tiny_stack.open()
    clients = _clients(tiny_stack, info)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    total = 0
    for turn, api in enumerate(apis):
        text, n = CALLERS[api](clients[api], messages, stream)
        assert isinstance(text, str) and n > 0
        total += n
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"More {turn}."}]
    stats = tiny_stack.stats(info)
    assert stats["turns"] == 2 == stats["api_calls"]
    assert stats["cumulative_hits"] == 1, "the echoed history did not match the recorded turn"
    samples = tiny_stack.loop.run(tiny_stack.gateway.finish_session(info.session_id, 1.0))
    assert len(samples) == 1
    s = samples[0]
    assert int(s.loss_mask.sum()) == total
    assert np.all(s.rollout_logprobs[s.loss_mask == 1] <= 0)


def test_usage_reports_the_engines_prefix_cache_hits(tiny_stack):
    """The second call with the same long prompt is served from the engine's prefix cache; each API
    reports it in its own usage field (Anthropic's input_tokens then excludes the cache read)."""
    info = tiny_stack.open()
    clients = _clients(tiny_stack, info)
    system = "You are a careful assistant. " * 12  # a long shared prefix
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say something."}]
    first = clients["chat"].chat.completions.create(model="any", messages=messages, max_tokens=4)
    second = clients["chat"].chat.completions.create(model="any", messages=messages, max_tokens=4)
    prompt = second.usage.prompt_tokens
    assert first.usage.prompt_tokens == prompt
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < prompt

    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": system}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say something."}]}]
    resp = clients["responses"].responses.create(model="any", input=items, max_output_tokens=4)
    assert resp.usage.input_tokens_details.cached_tokens > 0

    kwargs = dict(model="claude-opus-4-8", max_tokens=4, system=system, messages=messages[1:])
    clients["anthropic"].messages.create(**kwargs)
    out = clients["anthropic"].messages.create(**kwargs)
    assert out.usage.cache_read_input_tokens > 0
    counted = clients["anthropic"].messages.count_tokens(model="claude-opus-4-8", system=system,
                                                          messages=messages[1:]).input_tokens
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == counted and out.usage.input_tokens > 0
