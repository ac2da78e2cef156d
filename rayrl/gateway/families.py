"""Model families: how a model writes tool calls and reasoning, and what its chat template does.

agentcore-rl-toolkit's ``renderer_family`` names a renderer that turns messages into tokens without the
model's own chat template. rayrl always renders with the model's template (the tokenizer's, or
``model.chat_template``): a second renderer could disagree with the template the model was trained on.
What a family decides here is the other half: which parser reads the model's completions back into
tool calls and reasoning (``gateway.tool_parser`` / ``gateway.reasoning_parser`` when ``auto``), and
what to expect of the template (``template``, for the docs and the tests that reproduce each family's
template behaviour: tests/gateway/test_families.py).

A family is found from the model's name and its HF config's ``model_type`` (``config.json`` sits in a
local model directory too, so a local path is no obstacle), or named outright (``Runner``'s
``model_type``, e.g. ``qwen2.5-3B``: :func:`family_of` reads family names as well as model names).

Why reasoning templates matter: Qwen3's and DeepSeek's templates drop the reasoning of earlier turns
when they render history, so re-rendering a conversation never reproduces the tokens the model sampled.
The gateway therefore builds each next prompt from the sampled tokens (cumulative token mode,
rayrl/gateway/render.py ``ChatRenderer.extend``), and an episode still trains as one Sample per
prefix-extending segment.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFamily:
    """One family: its parsers, the name fragments that identify it, and what its template does."""

    name: str
    tool_parser: str  # a key of rayrl.gateway.parsers.TOOL_PARSERS
    reasoning_parser: str  # think | none
    markers: tuple[str, ...]  # lower-case fragments of "<model name> <model_type>"
    template: str  # tool calls, reasoning and system prompt, as the family's chat template renders them


FAMILIES: tuple[ModelFamily, ...] = (  # checked in this order: the first family with a matching marker wins
    ModelFamily(
        "llama3", "llama3", "none", ("llama-3", "llama3"),
        "tool calls as bare JSON {name, parameters} (after <|python_tag|>); no reasoning; system prompt "
        "in its own header block",
    ),
    ModelFamily(
        "deepseek", "deepseek", "think", ("deepseek",),
        "system text first, untagged; turns as <｜User｜> / <｜Assistant｜>; tool calls in a "
        "<｜tool▁calls▁begin｜> block, results in a <｜tool▁outputs▁begin｜> block; the reasoning of "
        "history turns is dropped (only the text after </think> is kept); R1's generation prompt opens "
        "<think>",
    ),
    ModelFamily(
        "qwen3", "hermes", "think", ("qwen3", "qwq"),
        "ChatML; tools listed in the system message, calls as <tool_call> JSON, results as "
        "<tool_response> in a user turn; no default system prompt; the completion opens <think>, and "
        "the reasoning of turns before the last user message is dropped when history is rendered",
    ),
    ModelFamily(
        "qwen2.5", "hermes", "none", ("qwen2", "qwen"),
        "ChatML; tools listed in the system message, calls as <tool_call> JSON, results as "
        "<tool_response> in a user turn; a default system prompt ('You are Qwen, ...') when none is "
        "given; no reasoning",
    ),
)
DEFAULT_FAMILY = ModelFamily(
    "hermes", "hermes", "none", (),
    "any other chat template; SmolLM2, Hermes and most chat models write <tool_call>{...}</tool_call>",
)


def family_of(model_name: str, model_type: str = "") -> ModelFamily:
    """The family of a model, from its name or path and its HF ``model_type`` (either may be a family
    name or carry a size, as ``qwen2.5-3B``); the Hermes-style default when nothing matches."""
    text = f"{model_name} {model_type}".lower()
    for family in FAMILIES:
        if any(marker in text for marker in family.markers):
            return family
    return DEFAULT_FAMILY
