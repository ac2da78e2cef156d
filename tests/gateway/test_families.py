"""Model families (rayrl/gateway/families.py): the parser registry, each family's template behaviour, and
reasoning templates through the real gateway.

Tokenizers and templates are built in the tests (tests/gateway/family_templates.py; Qwen2.5's is in
test_qwen_template.py). The reasoning tests run the whole gateway path: an OpenAI SDK client, the
gateway over loopback HTTP, a scripted engine that answers with token ids, and the session's tree.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import openai
import pytest

from rayrl.config import GatewayConfig
from rayrl.gateway.families import DEFAULT_FAMILY, FAMILIES, family_of
from rayrl.gateway.parsers import (
    DeepSeekToolParser,
    HermesToolParser,
    ThinkReasoningParser,
    get_tool_parser,
    infer_family,
    parse_completion,
)
from rayrl.gateway.render import ChatRenderer, normalize_messages
from rayrl.gateway.tools import chat_tools
from tests.gateway.family_templates import (
    CALC,
    QWEN_SPECIAL,
    build_tokenizer,
    deepseek_tokenizer,
    qwen3_tokenizer,
)
from tests.gateway.test_qwen_template import QWEN25_TEMPLATE

CALL = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+1"}'}}


@pytest.fixture(scope="module")
def qwen3():
    return qwen3_tokenizer()


@pytest.fixture(scope="module")
def deepseek():
    return deepseek_tokenizer()


@pytest.fixture(scope="module")
def qwen25():
    return build_tokenizer(QWEN25_TEMPLATE, QWEN_SPECIAL, ["<tool_call>", "</tool_call>"], eos="<|im_end|>")


# -- the registry ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, model_type, family", [
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2", "qwen2.5"),
    ("/data/ckpt/step-100", "qwen2", "qwen2.5"),  # a local path: config.json's model_type decides
    ("Qwen/Qwen3-8B", "qwen3", "qwen3"),
    ("/data/ckpt", "qwen3_moe", "qwen3"),
    ("Qwen/QwQ-32B", "qwen2", "qwen3"),
    ("deepseek-ai/DeepSeek-V3", "deepseek_v3", "deepseek"),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "qwen2", "deepseek"),  # its template is DeepSeek's
    ("meta-llama/Llama-3.1-8B-Instruct", "llama", "llama3"),
    ("smollm2-135m-instruct", "llama", "hermes"),
    ("/m", "qwen2.5-3B", "qwen2.5"),  # the Runner's model_type: a family name with a size
])
def test_family_of_model_names_and_types(name, model_type, family):
    found = family_of(name, model_type)
    assert found.name == family
    assert infer_family(name, model_type) == (found.tool_parser, found.reasoning_parser)
    assert get_tool_parser(found.tool_parser).name == found.tool_parser


def test_every_family_names_a_real_parser_and_describes_its_template():
    assert {f.name for f in FAMILIES} >= {"qwen2.5", "qwen3", "deepseek"}
    for family in FAMILIES:
        assert family_of(family.name) is family  # a family's own name picks it
        get_tool_parser(family.tool_parser)
        assert family.reasoning_parser in ("think", "none") and family.template
    assert family_of("gpt-2") is DEFAULT_FAMILY


# -- each family's template behaviour --------------------------------------------------------------


def test_qwen25_default_system_prompt_and_no_reasoning(qwen25):
    renderer = ChatRenderer(qwen25, HermesToolParser())
    text = renderer.render_text(normalize_messages([{"role": "user", "content": "hi"}]), None, True)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    own = renderer.render_text(normalize_messages([{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "hi"}]), None, True)
    assert own.startswith("<|im_start|>system\nBe brief.<|im_end|>") and "Alibaba" not in own
    assert family_of("Qwen2.5-3B-Instruct").reasoning_parser == "none"
    assert not renderer.generation_prompt_opens_think()


@pytest.mark.parametrize("family", ["qwen3", "deepseek", "qwen25"])
def test_the_direct_render_is_apply_chat_template(request, family):
    """The renderer's own render (the compiled template, globals flattened once) writes exactly what
    transformers' apply_chat_template writes, with tools and without, for each family's template."""
    tokenizer = request.getfixturevalue(family)
    direct = ChatRenderer(tokenizer, HermesToolParser())
    assert direct._direct is not None
    through_transformers = ChatRenderer(tokenizer, HermesToolParser())
    through_transformers._direct = None
    messages = normalize_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "<think>\nuse calc\n</think>\n\nOn it.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        {"role": "user", "content": "And 2*3?"},
    ])
    for tools, generation_prompt in itertools.product((None, chat_tools([CALC])), (True, False)):
        assert (direct.render_text(messages, tools, generation_prompt)
                == through_transformers.render_text(messages, tools, generation_prompt))


def test_qwen3_tools_calls_system_prompt_and_dropped_reasoning(qwen3):
    renderer = ChatRenderer(qwen3, HermesToolParser())
    assert renderer.supports_tools and renderer.supports_tool_calls
    assert not renderer.generation_prompt_opens_think()  # Qwen3 opens <think> itself, in the completion
    messages = normalize_messages([
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "<think>\nuse calc\n</think>\n\nOn it.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        {"role": "assistant", "content": "<think>\nit said 2\n</think>\n\nIt is 2."},
        {"role": "user", "content": "And 2*3?"},
    ])
    text = renderer.render_text(messages, chat_tools([CALC]), add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools")  # no default system prompt, tools listed
    assert "You are Qwen" not in text
    assert "<think>" not in text  # both assistant turns precede the last user message: reasoning dropped
    assert ('<|im_start|>assistant\nOn it.\n<tool_call>\n{"name": "calc", "arguments": {"e": "1+1"}}\n</tool_call>'
            in text)
    assert "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>" in text
    # the same turns as the tail of a tool loop (no later user message) keep their reasoning
    loop = renderer.render_text(messages[:4], chat_tools([CALC]), add_generation_prompt=False)
    assert "<think>\nuse calc\n</think>\n\nOn it." in loop and "<think>\nit said 2\n</think>" in loop
    # what a Qwen3 model writes parses into reasoning, content and the call
    completion = ('<think>\nuse calc\n</think>\n\nOn it.\n'
                  '<tool_call>\n{"name": "calc", "arguments": {"e": "1+1"}}\n</tool_call>')
    parsed = parse_completion(completion, HermesToolParser(), ThinkReasoningParser())
    assert parsed.reasoning == "use calc" and parsed.content == "On it."
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"e": "1+1"}]


def test_deepseek_tools_calls_system_prompt_and_reasoning(deepseek):
    parser = DeepSeekToolParser()
    renderer = ChatRenderer(deepseek, parser)
    assert renderer.generation_prompt_opens_think()  # R1: the completion starts inside <think>
    assert renderer.supports_tool_calls and not renderer.supports_tools  # schemas go into the system text
    messages = normalize_messages([
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "use calc\n</think>", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    ])
    text = renderer.render_text(messages, chat_tools([CALC]), add_generation_prompt=True)
    assert text.startswith("<｜begin▁of▁sentence｜>You are a careful agent.\n\n## Tools\n")  # untagged system
    assert "use calc" not in text  # history keeps only the text after </think>
    block = parser.format_tool_calls([CALL])
    assert "<｜Assistant｜>" + block + "<｜end▁of▁sentence｜>" in text  # the parser writes what the template does
    assert text.endswith("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>2<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
                         "<｜Assistant｜><think>\n")
    completion = "use calc\n</think>\n\n" + block
    parsed = parse_completion(completion, parser, ThinkReasoningParser(opened_in_prompt=True))
    assert parsed.reasoning == "use calc" and parsed.content == "" and not parsed.errors
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("calc", {"e": "1+1"})]
    # V3.1's form (no type, no fence) and a call cut at the stop string parse too; junk is an error, not a call
    v31 = parser.parse('x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calc<｜tool▁sep｜>{"e": "3"}<｜tool▁call▁end｜>')
    assert v31.content == "x" and json.loads(v31.tool_calls[0]["function"]["arguments"]) == {"e": "3"}
    cut = parser.parse(parser.forced_prefix("calc") + '{"e": "4"}\n```')
    assert json.loads(cut.tool_calls[0]["function"]["arguments"]) == {"e": "4"}
    bad = parser.parse("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n```json\n[1]\n```")
    assert not bad.tool_calls and bad.errors
    assert parser.safe_content("thinking done <｜tool▁calls") == "thinking done"


@pytest.mark.parametrize("family", ["qwen3", "deepseek"])
def test_gateway_picks_the_family_parsers(scripted, qwen3, deepseek, family):
    tok, name = (qwen3, "Qwen/Qwen3-8B") if family == "qwen3" else (deepseek, "deepseek-ai/DeepSeek-R1")
    stack = scripted(lambda prompt: "x", cfg=GatewayConfig(), tokenizer=tok, model_name=name)
    assert stack.gateway.tool_parser.name == next(f for f in FAMILIES if f.name == family).tool_parser
    assert stack.gateway.reasoning_parser is not None
    assert stack.gateway.reasoning_parser.opened_in_prompt == (family == "deepseek")


# -- reasoning templates through the gateway --------------------------------------------------------


def _reasoning_script(opens_in_prompt: bool):
    """A reasoning model: thinks, calls calc for each question, answers once it has the tool result."""

    def script(prompt: str) -> str:
        think = "" if opens_in_prompt else "<think>\n"
        tail = prompt[max(prompt.rfind("<|im_start|>user"), prompt.rfind("<｜User｜>")):]
        if "<tool_response>" in tail or "<｜tool▁output▁begin｜>" in tail:
            value = tail.split("<tool_response>\n")[-1].split("<｜tool▁output▁begin｜>")[-1][:1]
            return f"{think}The tool said {value}.\n</think>\n\nIt is {value}."
        expr = "2*3" if "2*3" in tail else "1+1"
        if opens_in_prompt:
            call = DeepSeekToolParser().format_tool_calls(
                [{"function": {"name": "calc", "arguments": json.dumps({"e": expr})}}])
        else:
            call = '<tool_call>\n{"name": "calc", "arguments": {"e": "' + expr + '"}}\n</tool_call>'
        return f"{think}I should use calc.\n</think>\n\n{call}"

    return script


def _episode(stack, client_model: str = "m") -> tuple[object, list]:
    """Two questions, each a tool call and an answer, through the OpenAI SDK; the client echoes
    history without reasoning (as most agent SDKs and CLIs do). Returns the session info and the
    finished session's samples."""
    info = stack.open()
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0)
    messages = [{"role": "system", "content": "You are a careful agent."}]
    for question, result in (("What is 1+1?", "2"), ("And 2*3?", "6")):
        messages.append({"role": "user", "content": question})
        first = client.chat.completions.create(model=client_model, messages=messages, tools=[CALC])
        (call,) = first.choices[0].message.tool_calls
        messages += [{"role": "assistant", "content": first.choices[0].message.content,
                      "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
        answer = client.chat.completions.create(model=client_model, messages=messages, tools=[CALC])
        assert answer.choices[0].message.content == f"It is {result}."
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    stats = stack.stats(info)
    samples = stack.loop.run(stack.gateway.finish_session(info.session_id, 1.0))
    return stats, samples


@pytest.mark.parametrize("family", ["qwen3", "deepseek"])
def test_template_that_drops_reasoning_still_trains_one_prefix_extending_sample(scripted, qwen3, deepseek, family):
    """Each later prompt is the previous prompt + the tokens actually sampled (reasoning included) +
    the new messages' tokens: never a re-render, so the whole episode is one Sample with its bridges
    masked, although the template renders history without the reasoning."""
    tok, name = (qwen3, "Qwen/Qwen3-8B") if family == "qwen3" else (deepseek, "deepseek-ai/DeepSeek-R1")
    stack = scripted(_reasoning_script(family == "deepseek"), cfg=GatewayConfig(), tokenizer=tok, model_name=name)
    stack.engine.eos = tok.eos_token_id
    stats, samples = _episode(stack)
    assert stats["turns"] == 4 and stats["cumulative_hits"] == 3
    assert stats["drift"] == {"response": 0, "bridge": 0, "context": 0, "truncated": 0}
    assert len(samples) == 1
    (sample,) = samples
    assert sample.metadata["turn_indices"] == [0, 1, 2, 3] and sample.metadata["drift"] is None
    prompts = stack.engine.prompts
    for before, after in itertools.pairwise(prompts):
        assert after.startswith(before)  # each prompt extends the one before
    text = tok.decode(sample.tokens.tolist())
    assert text.count("I should use calc.") == 2 and text.count("The tool said") == 2  # the sampled reasoning
    response = sample.tokens[sample.prompt_length:]
    trained = tok.decode(response[sample.loss_mask == 1].tolist())
    masked = tok.decode(response[sample.loss_mask == 0].tolist())
    assert "I should use calc." in trained and "It is 6." in trained
    assert "What is" not in trained and "And 2*3?" in masked and "6" in masked  # bridges: mask 0
    assert np.all(sample.rollout_logprobs[sample.loss_mask == 1] == np.float32(-0.25))
    # the control: re-rendering each prompt (no cumulative token mode) drifts where reasoning was dropped
    # (Qwen3: in the previous response; DeepSeek-R1: already at the <think> its generation prompt opened)
    plain = scripted(_reasoning_script(family == "deepseek"), cfg=GatewayConfig(cumulative_token_mode=False),
                     tokenizer=tok, model_name=name)
    plain.engine.eos = tok.eos_token_id
    stats, samples = _episode(plain)
    assert stats["drift"]["response" if family == "qwen3" else "bridge"] >= 1 and len(samples) > 1
