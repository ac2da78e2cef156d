"""Chat templates and tokenizers of the Qwen3 and DeepSeek families, built in the tests.

The templates are written here from each family's documented template behaviour (not copied):

* ``QWEN3_TEMPLATE``: ChatML; with tools, the system message lists them in ``<tools>`` and says how to
  call; no default system prompt; assistant tool calls as ``<tool_call>`` JSON after the content; tool
  results as ``<tool_response>`` blocks in one user turn. Reasoning: an assistant message after the
  last real user message keeps its reasoning (``reasoning_content``, or ``<think>`` in its content), and
  the last message is always given a ``<think>`` block, empty if need be; earlier assistant messages
  lose theirs. So a conversation re-rendered as history never reproduces the ``<think>`` tokens the
  model sampled: the drift reasoning models are known for.
* ``DEEPSEEK_TEMPLATE``: BOS, then the system text untagged; turns as ``<｜User｜>`` / ``<｜Assistant｜>``;
  tool calls in a ``<｜tool▁calls▁begin｜>`` block (``function<｜tool▁sep｜>name`` + fenced JSON), results
  in a ``<｜tool▁outputs▁begin｜>`` block; history keeps only the text after ``</think>``; the generation
  prompt opens ``<think>`` (R1), so completions start inside the reasoning.

The Qwen2.5 template is tests/gateway/test_qwen_template.py's ``QWEN25_TEMPLATE``. Tokenizers are small
byte-level BPEs trained on the spot, with each family's markers as added tokens.
"""

from __future__ import annotations

import json
from typing import Any

QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>')) %}"
    "{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function write <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}"
    "{%- set reasoning = m.reasoning_content or '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- content }}"
    "{%- for c in m.tool_calls or [] %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{{- c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEEPSEEK_TEMPLATE = (
    "{%- set ns = namespace(system='', in_outputs=false) %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{%- set ns.system = ns.system + m.content %}{%- endif %}"
    "{%- endfor %}"
    "{{- bos_token + ns.system }}"
    "{%- for m in messages %}"
    "{%- if m.role in ('user', 'assistant') and ns.in_outputs %}"
    "{{- '<｜tool▁outputs▁end｜>' }}{%- set ns.in_outputs = false %}"
    "{%- endif %}"
    "{%- if m.role == 'user' %}{{- '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<｜Assistant｜>' + (m.content or '').split('</think>')[-1] }}"
    "{%- if m.tool_calls %}{{- '<｜tool▁calls▁begin｜>' }}"
    "{%- for c in m.tool_calls %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + c.function.name + '\\n```json\\n' }}"
    "{{- c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}"
    "{{- '\\n```<｜tool▁call▁end｜>' }}"
    "{%- endfor %}"
    "{{- '<｜tool▁calls▁end｜>' }}{%- endif %}"
    "{{- '<｜end▁of▁sentence｜>' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if not ns.in_outputs %}{{- '<｜tool▁outputs▁begin｜>' }}{%- set ns.in_outputs = true %}{%- endif %}"
    "{{- '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if ns.in_outputs %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\\n' }}{%- endif %}"
)

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
DEEPSEEK_ADDED = ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                  "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                  "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<think>", "</think>"]

CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate an expression",
                                         "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}
CORPUS = ["What is 1+1? And 2*3? I should use calc. The tool said 2. It is 2. It is 6. You are a careful agent.",
          'system user assistant {"name": "calc", "arguments": {"e": "1+1"}} tool_response function json',
          json.dumps(CALC)]


def build_tokenizer(template: str, special: list[str], added: list[str], eos: str, bos: str | None = None) -> Any:
    """A byte-level BPE trained on a small corpus, with ``special`` tokens, ``added`` (non-special: they
    survive decoding, as a model's markup tokens do) and ``template`` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([template, *CORPUS] * 4, trainer)
    kwargs = {"bos_token": bos} if bos else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, pad_token=special[0],
                                  additional_special_tokens=[t for t in special if t not in (eos, bos)], **kwargs)
    tok.add_tokens(added)
    tok.chat_template = template
    return tok


def qwen3_tokenizer() -> Any:
    return build_tokenizer(QWEN3_TEMPLATE, QWEN_SPECIAL, QWEN3_ADDED, eos="<|im_end|>")


def deepseek_tokenizer() -> Any:
    return build_tokenizer(DEEPSEEK_TEMPLATE, DEEPSEEK_SPECIAL, DEEPSEEK_ADDED, eos="<｜end▁of▁sentence｜>",
                           bos="<｜begin▁of▁sentence｜>")
