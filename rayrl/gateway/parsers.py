"""Tool-call and reasoning parsers, by model family.

A parser turns the model's raw completion text into an OpenAI-shape assistant message (content,
tool_calls, reasoning) and back: ``format_tool_calls`` writes tool calls in the exact text form the
family generates, which the renderer uses for chat templates that know nothing about tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ParsedOutput:
    """The pieces of one completion."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None
    errors: list[str] = field(default_factory=list)  # tool-call blocks that could not be parsed


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _tool_call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolParser:
    """Base class: no tool calls, text passes through."""

    name = "none"

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=text)

    def format_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        return ""

    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return ""


class HermesToolParser(ToolParser):
    """Qwen / Hermes style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    name = "hermes"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        if "<tool_call>" not in text:
            return ParsedOutput(content=text)
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        for match in self._block.finditer(text):
            raw = match.group(1).strip()
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as err:
                errors.append(f"invalid JSON in <tool_call>: {err.msg}")
                continue
            for item in obj if isinstance(obj, list) else [obj]:  # SmolLM2 writes a JSON list of calls
                if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
                    errors.append("<tool_call> must hold an object with a non-empty string 'name'")
                    continue
                calls.append(_tool_call(item["name"], item.get("arguments", item.get("parameters", {}))))
        content = text[: text.index("<tool_call>")].strip()
        return ParsedOutput(content=content, tool_calls=calls, errors=errors)

    def format_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        parts = []
        for call in tool_calls:
            fn = call.get("function", {})
            args = fn.get("arguments", "{}")
            try:
                args_obj = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                args_obj = args
            parts.append(
                "<tool_call>"
                + json.dumps({"name": fn.get("name", ""), "arguments": args_obj}, ensure_ascii=False)
                + "</tool_call>"
            )
        return "\n".join(parts)

    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str:
        specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        return (
            "\n\n# Tools\nYou may call one or more functions. Function signatures:\n<tools>\n"
            + specs
            + '\n</tools>\nTo call a function, write <tool_call>{"name": <name>, "arguments": <args>}</tool_call>'
        )


class Llama3JsonToolParser(ToolParser):
    """Llama-3.x JSON tool calls: ``{"name": ..., "parameters": {...}}`` (optionally after <|python_tag|>)."""

    name = "llama3"

    def parse(self, text: str) -> ParsedOutput:
        stripped = text.strip()
        if stripped.startswith("<|python_tag|>"):
            stripped = stripped[len("<|python_tag|>") :].strip()
        if not stripped.startswith("{"):
            return ParsedOutput(content=text)
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(stripped):
            try:
                obj, end = decoder.raw_decode(stripped, pos)
            except json.JSONDecodeError as err:
                errors.append(f"invalid JSON tool call: {err.msg}")
                break
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]:
                calls.append(_tool_call(obj["name"], obj.get("parameters", obj.get("arguments", {}))))
            else:
                return ParsedOutput(content=text)
            pos = end
            while pos < len(stripped) and stripped[pos] in " \n;":
                pos += 1
        return ParsedOutput(content="" if calls else text, tool_calls=calls, errors=errors)

    def format_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        out = []
        for call in tool_calls:
            fn = call.get("function", {})
            args = fn.get("arguments", "{}")
            args_obj = json.loads(args) if isinstance(args, str) and args.strip() else {}
            out.append(json.dumps({"name": fn.get("name", ""), "parameters": args_obj}, ensure_ascii=False))
        return "; ".join(out)


class ThinkReasoningParser:
    """``<think>...</think>`` reasoning (Qwen3, DeepSeek-R1 style), split from the answer."""

    name = "think"

    def split(self, text: str) -> tuple[str | None, str]:
        if "</think>" not in text:
            if text.lstrip().startswith("<think>"):
                return text.lstrip()[len("<think>") :], ""
            return None, text
        head, _, tail = text.partition("</think>")
        reasoning = head.split("<think>", 1)[-1].strip("\n")
        return reasoning, tail.lstrip("\n")


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3": Llama3JsonToolParser,
    "none": ToolParser,
}


def infer_family(model_name: str, model_type: str = "") -> tuple[str, str]:
    """(tool parser, reasoning parser) for a model; Hermes style is the default for chat models."""
    name = f"{model_name} {model_type}".lower()
    if "llama-3" in name or "llama3" in name:
        return "llama3", "none"
    if "qwen3" in name or "deepseek-r1" in name:
        return "hermes", "think"
    return "hermes", "none"


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; choose from {sorted(TOOL_PARSERS)}") from None


def parse_completion(text: str, tool_parser: ToolParser, reasoning: ThinkReasoningParser | None) -> ParsedOutput:
    """Split reasoning (if a reasoning parser is set), then tool calls, from one completion."""
    thought = None
    if reasoning is not None:
        thought, text = reasoning.split(text)
    parsed = tool_parser.parse(text)
    parsed.reasoning = thought
    return parsed
