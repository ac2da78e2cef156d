"""How streams end and what they carry, with the real SDKs (scripted engine for exact token counts).

- A generation cut by the token limit: Responses ends with ``response.incomplete`` (status
  ``incomplete``, ``incomplete_details.reason = max_output_tokens``), streaming and not; Anthropic says
  ``stop_reason: "max_tokens"``; Chat Completions ``finish_reason: "length"``.
- Chat Completions streaming with ``logprobs``: every output token's log-prob arrives exactly once, in
  order, the same list the non-streaming answer has; content chunks carry their tokens' log-probs.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

LONG = "one two three four five six seven eight nine ten eleven twelve"
CALL = 'Computing.\n<tool_call>{"name": "calc", "arguments": {"e": "1+1"}}</tool_call>'
CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


@pytest.fixture
def stack(scripted):
    return scripted(lambda prompt: CALL if "calc" in prompt else LONG, token_delay_s=0.001)


def test_responses_max_output_tokens_is_incomplete(stack):
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    out = client.responses.create(model="m", input="count", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.output_text
    events = list(client.responses.create(model="m", input="count", max_output_tokens=3, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 3 and final.output[0].content[0].text == out.output_text
    # not cut off: completed, as before
    done = list(client.responses.create(model="m", input="count", max_output_tokens=100, stream=True))
    assert done[-1].type == "response.completed" and done[-1].response.incomplete_details is None


def test_anthropic_and_chat_token_limit(stack):
    info = stack.open()
    an = anthropic.Anthropic(base_url=stack.root, api_key=info.token, max_retries=0)
    kwargs = dict(model="claude-x", max_tokens=3, messages=[{"role": "user", "content": "count"}])
    assert an.messages.create(**kwargs).stop_reason == "max_tokens"
    with an.messages.stream(**kwargs) as s:
        assert s.get_final_message().stop_reason == "max_tokens"
    oa = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    msgs = [{"role": "user", "content": "count"}]
    assert oa.chat.completions.create(model="m", messages=msgs, max_tokens=3).choices[0].finish_reason == "length"
    finishes = [c.choices[0].finish_reason for c in oa.chat.completions.create(model="m", messages=msgs,
                                                                               max_tokens=3, stream=True)]
    assert finishes[-1] == "length"


def _streamed_logprobs(client, **kwargs):
    """[(content delta, [(token, logprob)...]) per chunk] of a logprobs stream."""
    chunks = []
    for chunk in client.chat.completions.create(model="m", stream=True, logprobs=True, **kwargs):
        choice = chunk.choices[0]
        lps = [(t.token, t.logprob) for t in choice.logprobs.content] if choice.logprobs else []
        chunks.append((choice.delta.content or "", lps, choice.finish_reason))
    return chunks


@pytest.mark.parametrize("tools", [None, [CALC]])
def test_chat_stream_logprobs_cover_every_token_once(stack, tools):
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    extra = {"tools": tools} if tools else {}
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], logprobs=True,
                                           **extra)
    expected = [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]
    assert len(expected) == whole.usage.completion_tokens
    chunks = _streamed_logprobs(client, messages=[{"role": "user", "content": "go"}], **extra)
    assert [lp for _, lps, _ in chunks for lp in lps] == expected
    assert "".join(c for c, _, _ in chunks) == (whole.choices[0].message.content or "")


def test_chat_stream_logprobs_arrive_with_content_chunks(stack):
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    chunks = _streamed_logprobs(client, messages=[{"role": "user", "content": "go"}])
    content_chunks = [(c, lps) for c, lps, finish in chunks if c and finish is None]
    assert len(content_chunks) > 3
    assert all(lps for _, lps in content_chunks)
