"""Qwen-family chat templates: tools and tool calls rendered the Qwen2.5 way, parsed back by hermes.

``QWEN25_TEMPLATE`` is written here from the behaviour of Qwen2.5-Instruct's public chat template: with
tools, a system message listing each tool as JSON inside ``<tools></tools>`` plus the call format;
assistant tool calls as ``<tool_call>\\n{"name": ..., "arguments": <object>}\\n</tool_call>`` after the
content; consecutive tool results grouped in one user turn as ``<tool_response>`` blocks; a default
system prompt. The tokenizer is a small byte-level BPE trained in the fixture with Qwen's special
tokens (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``) and, as in Qwen2.5, ``<tool_call>`` and
``</tool_call>`` as added (non-special) tokens.
"""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from rayrl.config import GatewayConfig
from rayrl.gateway.parsers import HermesToolParser, get_tool_parser, infer_family
from rayrl.gateway.render import ChatRenderer, normalize_messages
from rayrl.gateway.tools import chat_tools

QWEN25_TEMPLATE = (
    "{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- default_system }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate an expression",
                                         "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}
CALL_1 = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+1"}'}}
CALL_2 = {"id": "call_2", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2*3"}'}}


@pytest.fixture(scope="module")
def qwen_tokenizer():
    """A small byte-level BPE with Qwen2.5's special and added tokens and the template above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [QWEN25_TEMPLATE, json.dumps(CALC), "What is 1+1? The answer is 2. Let me compute both.",
              'user assistant system {"name": "calc", "arguments": {"e": "1+1"}} tool_response'] * 4
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # Qwen2.5: added, not special (they survive decoding)
    tok.chat_template = QWEN25_TEMPLATE
    return tok


def test_registry_picks_hermes_for_qwen():
    for name, model_type in [("Qwen/Qwen2.5-7B-Instruct", ""), ("Qwen2.5-0.5B-Instruct", "qwen2"),
                             ("my-finetune", "qwen2"), ("Qwen/QwQ-32B", "qwen2")]:
        assert get_tool_parser(infer_family(name, model_type)[0]).name == "hermes", name
    assert infer_family("Qwen/Qwen2.5-7B-Instruct", "qwen2") == ("hermes", "none")
    assert infer_family("Qwen/Qwen3-8B", "qwen3") == ("hermes", "think")


def _assistant_segments(text: str) -> list[str]:
    """The assistant turns of a ChatML text (between ``<|im_start|>assistant`` and ``<|im_end|>``)."""
    parts = text.split("<|im_start|>assistant")[1:]
    return [p.split("<|im_end|>")[0] for p in parts if "<|im_end|>" in p]


def test_qwen_template_renders_tools_and_calls_that_hermes_parses_back(qwen_tokenizer):
    renderer = ChatRenderer(qwen_tokenizer, HermesToolParser())
    assert renderer.supports_tools and renderer.supports_tool_calls
    messages = normalize_messages([
        {"role": "user", "content": "What is 1+1 and 2*3?"},
        {"role": "assistant", "content": "Let me compute both.", "tool_calls": [CALL_1, CALL_2]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        {"role": "tool", "tool_call_id": "call_2", "content": "6"},
    ])
    tools = chat_tools([CALC])
    text = renderer.render_text(messages, tools, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert "<tools>\n" + json.dumps(tools[0], ensure_ascii=False) + "\n</tools>" in text
    # arguments rendered as JSON objects (the template's `| tojson`), not a JSON-encoded string
    assert ('<|im_start|>assistant\nLet me compute both.\n<tool_call>\n{"name": "calc", "arguments": {"e": "1+1"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "calc", "arguments": {"e": "2*3"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n6\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text
    # hermes reads the rendered assistant turn back into the same message
    (segment,) = _assistant_segments(text)
    parsed = HermesToolParser().parse(segment.removeprefix("\n"))
    assert parsed.content == "Let me compute both." and not parsed.errors
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("calc", {"e": "1+1"}), ("calc", {"e": "2*3"})]
    # the canonical (recorded) messages still hold arguments as strings
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"e": "1+1"}'
    # tokens: <tool_call> is one token and the prompt decodes back to the text exactly
    ids = renderer.render(messages, tools)
    assert qwen_tokenizer.decode(ids.tolist()) == text
    assert ids.tolist().count(qwen_tokenizer.convert_tokens_to_ids("<tool_call>")) == text.count("<tool_call>") == 4


def test_hermes_forced_prefixes_are_how_qwen_renders_a_call(qwen_tokenizer):
    renderer = ChatRenderer(qwen_tokenizer, HermesToolParser())
    messages = normalize_messages([{"role": "user", "content": "1+1?"},
                                   {"role": "assistant", "content": None, "tool_calls": [CALL_1]}])
    (segment,) = _assistant_segments(renderer.render_text(messages, chat_tools([CALC]), add_generation_prompt=False))
    hermes = HermesToolParser()
    assert segment.removeprefix("\n").startswith(hermes.forced_prefix("calc"))
    assert segment.removeprefix("\n").startswith(hermes.forced_prefix(None))


def _qwen_script(prompt: str) -> str:
    """A Qwen-like model: calls calc (in Qwen's own form) until it has a tool response."""
    start = prompt[prompt.rfind("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
    if "<tool_response>" in prompt[prompt.rfind("<|im_start|>user"):]:
        return "It is 2."
    call = '<tool_call>\n{"name": "calc", "arguments": {"e": "1+1"}}\n</tool_call>'
    return call[len(start):] if call.startswith(start) else call


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_qwen_gateway_tool_loop_is_one_sample(scripted, qwen_tokenizer, tool_choice):
    """Through the gateway with the parser picked for a Qwen model: the call is parsed, the tool turn's
    prompt extends the recorded tokens, and a full re-render gives the same text (no drift)."""
    stack = scripted(_qwen_script, cfg=GatewayConfig(tool_parser="auto", reasoning_parser="auto"),
                     tokenizer=qwen_tokenizer, model_name="Qwen2.5-0.5B-Instruct")
    assert stack.gateway.tool_parser.name == "hermes" and stack.gateway.reasoning_parser is None
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    messages = [{"role": "user", "content": "What is 1+1?"}]
    first = client.chat.completions.create(model="qwen", messages=messages, tools=[CALC], tool_choice=tool_choice)
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"e": "1+1"}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "2"}]
    second = client.chat.completions.create(model="qwen", messages=messages, tools=[CALC])
    assert second.choices[0].message.content == "It is 2."
    stats = stack.stats(info)
    assert stats["cumulative_hits"] == 1 and sum(stats["drift"].values()) == 0
    # the model wrote its call exactly as the template renders one: re-rendering cannot drift
    rerendered = stack.gateway.renderer.render_text(normalize_messages(messages), chat_tools([CALC]), True)
    assert stack.engine.prompts[-1] == rerendered
    samples = stack.loop.run(stack.gateway.finish_session(info.session_id, 1.0))
    assert len(samples) == 1 and np.all(samples[0].rollout_logprobs[samples[0].loss_mask == 1] == np.float32(-0.25))
