"""Message normalisation, tool-call parsers and prompt rendering with the real SmolLM2 tokenizer."""

import json

import numpy as np
import pytest

from rayrl.gateway.errors import RequestError
from rayrl.gateway.parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ThinkReasoningParser,
    parse_completion,
)
from rayrl.gateway.render import ChatRenderer, normalize_messages
from rayrl.gateway.tools import chat_tools
from rayrl.types import TurnRecord


def test_normalize_canonical_shape():
    msgs = normalize_messages(
        [
            {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
            {"role": "user", "content": "hi", "name": None},
            {"role": "assistant", "content": None, "refusal": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ]
    )
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1] == {"role": "user", "content": "hi"}
    assert msgs[2] == {"role": "assistant", "content": "",
                       "tool_calls": [{"id": "c1", "type": "function",
                                       "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    assert msgs[3] == {"role": "tool", "content": "2", "tool_call_id": "c1"}


@pytest.mark.parametrize(
    "bad",
    [None, [], "hi", [{"role": "robot", "content": "x"}], [{"role": "user", "content": 5}],
     [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     [{"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}], ["not a dict"]],
)
def test_normalize_rejects_bad_messages(bad):
    with pytest.raises(RequestError):
        normalize_messages(bad)


def test_chat_tools():
    assert chat_tools(None) is None and chat_tools([]) is None
    tools = chat_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert tools[0]["function"]["name"] == "f"
    for bad in ["x", [{"type": "web"}], [{"type": "function", "function": {"name": 3}}],
                [{"type": "function", "function": {"name": "f", "parameters": []}}]]:
        with pytest.raises(RequestError):
            chat_tools(bad)


def test_hermes_parser_object_list_and_errors():
    p = HermesToolParser()
    out = p.parse('ok <tool_call>{"name": "calc", "arguments": {"e": "1+1"}}</tool_call>')
    assert out.content == "ok" and out.tool_calls[0]["function"]["name"] == "calc"
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"e": "1+1"}
    two = p.parse('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>')
    assert [c["function"]["name"] for c in two.tool_calls] == ["a", "b"]
    multi = p.parse('<tool_call>{"name": "a"}</tool_call>\n<tool_call>{"name": "b"}</tool_call>')
    assert len(multi.tool_calls) == 2
    bad = p.parse('<tool_call>{"name": "calc", "arguments": {"e": 1+1}}</tool_call>')
    assert not bad.tool_calls and bad.errors
    assert p.parse("plain answer").content == "plain answer"
    # round trip: the text form the renderer writes parses back to the same call
    again = p.parse(p.format_tool_calls(out.tool_calls))
    assert again.tool_calls[0]["function"] == out.tool_calls[0]["function"]


def test_llama3_and_think_parsers():
    p = Llama3JsonToolParser()
    out = p.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')
    assert [c["function"]["name"] for c in out.tool_calls] == ["f", "g"]
    assert p.parse("The answer is {not json").content == "The answer is {not json"
    parsed = parse_completion("<think>hmm\n</think>\nThe answer is 4.", HermesToolParser(), ThinkReasoningParser())
    assert parsed.reasoning == "hmm" and parsed.content == "The answer is 4."


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from rayrl.models import provision_smollm2

    return AutoTokenizer.from_pretrained(provision_smollm2())


def test_render_writes_tool_calls_for_templates_without_tool_support(tokenizer):
    r = ChatRenderer(tokenizer, HermesToolParser(), inject_tool_schemas=True)
    assert not r.supports_tools
    msgs = normalize_messages(
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "1", "type": "function",
                             "function": {"name": "calc", "arguments": "{\"e\": \"2\"}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "2"},
        ]
    )
    tools = chat_tools([{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}])
    text = r.render_text(msgs, tools, add_generation_prompt=True)
    assert '<tool_call>{"name": "calc", "arguments": {"e": "2"}}</tool_call>' in text
    assert "<tools>" in text and text.endswith("<|im_start|>assistant\n")
    ids = r.render(msgs, tools)
    assert ids.dtype == np.int32 and tokenizer.decode(ids.tolist()) == text


def test_cumulative_extend_reuses_exact_tokens(tokenizer):
    r = ChatRenderer(tokenizer, HermesToolParser())
    first = normalize_messages([{"role": "user", "content": "What is 2+2?"}])
    prompt = r.render(first, None)
    # the model's own tokens, deliberately NOT what re-tokenising the text would give
    response_ids = np.array(tokenizer(" The  answer", add_special_tokens=False)["input_ids"] + [2], dtype=np.int32)
    turn = TurnRecord(first, {"role": "assistant", "content": "The  answer"}, prompt, response_ids,
                      np.zeros(len(response_ids), np.float32))
    nxt = first + [turn.response_message, {"role": "user", "content": "thanks"}]
    ids = r.extend(turn, nxt, None)
    assert ids is not None
    assert np.array_equal(ids[: len(prompt) + len(response_ids)], np.concatenate([prompt, response_ids]))
    full = r.render(nxt, None)
    # the tokens after the recorded response equal the tail of a full re-render
    tail = tokenizer.decode(ids[len(prompt) + len(response_ids):].tolist())
    assert tokenizer.decode(full.tolist()).endswith(tail)
    assert tail.startswith("\n<|im_start|>user\nthanks<|im_end|>")


def test_loop_reads_skip_the_sandbox_checks_and_nothing_else(tokenizer):
    """The direct render reads jinja's ``loop`` numbers without the sandbox's per-read checks
    (render._with_loop_reads) and renders what apply_chat_template renders; every other attribute read is
    still checked (a private attribute of ``loop`` and a list's mutating method stay refused), and
    transformers' own environment is left as it was."""
    from jinja2.exceptions import SecurityError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = (
        "{% for message in messages %}{{ loop.first }}|{{ loop.last }}|{{ loop.index }}|{{ loop.index0 }}|"
        "{{ loop.revindex }}|{{ loop.revindex0 }}|{{ loop.length }}|{{ loop.depth }}|{{ loop.depth0 }}|"
        "{{ loop.previtem['role'] if loop.previtem else '-' }}|{{ message['role'] }}:{{ message['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}GO{% endif %}"
    )
    renderer = ChatRenderer(tokenizer, HermesToolParser(), chat_template=template)
    assert renderer._direct is not None
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    for prompt in (True, False):
        assert renderer._apply_template(messages, None, prompt) == tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=prompt)
    assert "getattr" not in vars(_compile_jinja_template(template).environment)

    def outcome(render):
        try:
            return render()
        except Exception as err:
            return type(err)

    for refused, refusal in (("{% for m in messages %}[{{ loop._after }}]{% endfor %}", "[][][][]"),
                             ("{% for m in messages %}{{ messages.append(m) }}{% endfor %}", SecurityError)):
        sneaky = ChatRenderer(tokenizer, HermesToolParser(), chat_template=refused)
        assert outcome(lambda refused=refused: tokenizer.apply_chat_template(messages, chat_template=refused,
                                                                           tokenize=False)) \
            == refusal
        if sneaky._direct is not None:
            assert outcome(lambda sneaky=sneaky: sneaky._direct(messages, None, False)) == refusal
