"""Tool-call and reasoning parsers, by model family (which family a model is: rayrl/gateway/families.py).

A parser turns the model's raw completion text into an OpenAI-shape assistant message (content,
tool_calls, reasoning) and back: ``format_tool_calls`` writes tool calls in the exact text form the
family generates, which the renderer uses for chat templates that know nothing about tools.

Streaming: ``safe_content`` (tool parsers) and ``partial`` (reasoning parser) give, for an unfinished
completion, the part of the final content/reasoning that no later token can change. A streaming
response sends exactly those prefixes as deltas, so the text a client reassembles from the stream is
the same ``content`` the non-streaming parse records, and an echoed history still matches the
recorded turn (cumulative token mode keeps working for streaming clients).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from rayrl.gateway.families import family_of


@dataclass
class ParsedOutput:
    """The pieces of one completion."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None
    errors: list[str] = field(default_factory=list)  # tool-call blocks that could not be parsed


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _tool_call(name: str, arguments: Any) -> dict[str, Any] | None:
    """An OpenAI tool call, or None when ``arguments`` is not a JSON object (every API we serve
    needs an object: Anthropic's ``input``, JSON-schema ``parameters``)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (held back while
    streaming: the next token may complete the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser:
    """Base class: no tool calls, text passes through.

    ``call_end``: the text that closes one tool call, used as a stop string when a turn may make at
    most one call; None when the family has no such marker (then parallel calls are not limited).
    """

    name = "none"
    call_end: str | None = None

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=text)

    def safe_content(self, text: str) -> str:
        """The prefix of ``parse(text + anything).content`` already certain for a partial ``text``."""
        return text

    def format_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        return ""

    def forced_prefix(self, name: str | None) -> str | None:
        """The opening of a tool call in this family's text form, appended to the prompt to force a
        call (of function ``name``, or of any function when None); the model writes the rest and
        the prefix + completion is parsed as one. None: this family cannot be forced.

        Why a prefix: the CPU engine has no grammar-constrained decoding; forcing the start of the
        assistant turn is exact for the forced part and leaves the rest to the model.
        """
        return None

    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return ""


class HermesToolParser(ToolParser):
    """Qwen / Hermes style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    name = "hermes"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    marker = "<tool_call>"
    call_end = "</tool_call>"

    def parse(self, text: str) -> ParsedOutput:
        """Content is the text before the first ``<tool_call>`` (trailing whitespace dropped). When
        no block parses, the raw text is the content, so the client still sees what the model wrote."""
        if self.marker not in text:
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
                call = _tool_call(item["name"], item.get("arguments", item.get("parameters", {})))
                if call is None:
                    errors.append("<tool_call> arguments must be a JSON object")
                    continue
                calls.append(call)
        if not calls:
            return ParsedOutput(content=text, errors=errors)
        content = text[: text.index(self.marker)].rstrip()
        return ParsedOutput(content=content, tool_calls=calls, errors=errors)

    def safe_content(self, text: str) -> str:
        if self.marker in text:
            return text[: text.index(self.marker)].rstrip()
        return text[: len(text) - partial_marker_len(text, self.marker)].rstrip()

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

    def forced_prefix(self, name: str | None) -> str | None:
        """Qwen2.5's own form (what its chat template renders for assistant tool calls)."""
        if name is None:
            return '<tool_call>\n{"name": "'
        return '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '

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
            call = None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]:
                call = _tool_call(obj["name"], obj.get("parameters", obj.get("arguments", {})))
            if call is None:
                return ParsedOutput(content=text)
            calls.append(call)
            pos = end
            while pos < len(stripped) and stripped[pos] in " \n;":
                pos += 1
        return ParsedOutput(content="" if calls else text, tool_calls=calls, errors=errors)

    def safe_content(self, text: str) -> str:
        """A completion that starts (after whitespace) with ``{`` or the python tag may be a call:
        nothing is certain until it ends. Anything else is plain content from the first token."""
        head = text.lstrip()
        tag = "<|python_tag|>"
        if not head or head.startswith("{") or head.startswith(tag) or tag.startswith(head):
            return ""
        return text

    def format_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        out = []
        for call in tool_calls:
            fn = call.get("function", {})
            args = fn.get("arguments", "{}")
            args_obj = json.loads(args) if isinstance(args, str) and args.strip() else {}
            out.append(json.dumps({"name": fn.get("name", ""), "parameters": args_obj}, ensure_ascii=False))
        return "; ".join(out)

    def forced_prefix(self, name: str | None) -> str | None:
        if name is None:
            return '{"name": "'
        return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "parameters": '


class DeepSeekToolParser(ToolParser):
    """DeepSeek-V3 / R1: calls in a ``<｜tool▁calls▁begin｜>`` block, one ``<｜tool▁call▁begin｜>`` each.

    A call is ``function<｜tool▁sep｜>NAME`` + a fenced JSON block of arguments (V3, R1), or
    ``NAME<｜tool▁sep｜>ARGS`` (V3.1); both parse. Content is the text before the block. Written from the
    format DeepSeek's chat template renders (tests/gateway/family_templates.py reproduces that template).
    """

    name = "deepseek"
    calls_begin = "<｜tool▁calls▁begin｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    sep = "<｜tool▁sep｜>"
    call_end = "<｜tool▁call▁end｜>"
    calls_end = "<｜tool▁calls▁end｜>"
    _call = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.DOTALL)
    _fenced = re.compile(r"^(.*?)\n```(?:json)?\s*\n?(.*?)\s*(?:```\s*)?$", re.DOTALL)

    def _start(self, text: str) -> int:
        found = [i for i in (text.find(self.calls_begin), text.find(self.call_begin)) if i >= 0]
        return min(found) if found else -1

    def parse(self, text: str) -> ParsedOutput:
        start = self._start(text)
        if start < 0:
            return ParsedOutput(content=text)
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        for match in self._call.finditer(text, start):
            head, body = match.group(1).strip(), match.group(2)
            fenced = self._fenced.match(body.strip())
            name, args = (fenced.group(1).strip(), fenced.group(2)) if fenced else (head, body.strip())
            if not name:
                errors.append("a DeepSeek tool call without a function name")
                continue
            call = _tool_call(name, args)
            if call is None:
                errors.append(f"tool call {name!r}: arguments must be a JSON object")
                continue
            calls.append(call)
        if not calls:
            return ParsedOutput(content=text, errors=errors)
        return ParsedOutput(content=text[:start].rstrip(), tool_calls=calls, errors=errors)

    def safe_content(self, text: str) -> str:
        start = self._start(text)
        if start >= 0:
            return text[:start].rstrip()
        held = max(partial_marker_len(text, self.calls_begin), partial_marker_len(text, self.call_begin))
        return text[: len(text) - held].rstrip()

    def _one(self, name: str, args: Any) -> str:
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return f"{self.call_begin}function{self.sep}{name}\n```json\n{text}\n```{self.call_end}"

    def format_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        body = "\n".join(self._one(str(c.get("function", {}).get("name", "")),
                                   c.get("function", {}).get("arguments", "{}")) for c in tool_calls)
        return f"{self.calls_begin}{body}{self.calls_end}" if tool_calls else ""

    def forced_prefix(self, name: str | None) -> str | None:
        prefix = f"{self.calls_begin}{self.call_begin}function{self.sep}"
        return prefix if name is None else prefix + name + "\n```json\n"

    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str:
        specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        return ("\n\n## Tools\nYou can call these functions:\n" + specs + "\nTo call functions, write "
                + self.calls_begin + ", then for each call " + self._one("<name>", "<arguments as a JSON object>")
                + ", then " + self.calls_end)


class ThinkReasoningParser:
    """``<think>...</think>`` reasoning (Qwen3, DeepSeek-R1 style), split from the answer.

    ``opened_in_prompt``: the chat template's generation prompt already opens ``<think>`` (DeepSeek-R1
    distills, QwQ), so the completion starts inside the reasoning and only ``</think>`` appears. Else
    a completion has reasoning only when it starts with ``<think>``; a stray ``</think>`` later in an
    answer is content.
    """

    name = "think"
    open_tag = "<think>"
    close_tag = "</think>"

    def __init__(self, opened_in_prompt: bool = False) -> None:
        self.opened_in_prompt = opened_in_prompt

    def _inner(self, text: str) -> str | None:
        """The text after the opening tag, or None when this completion has no reasoning."""
        head = text.lstrip()
        if head.startswith(self.open_tag):
            return head[len(self.open_tag) :]
        return text if self.opened_in_prompt else None

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a finished completion."""
        inner = self._inner(text)
        if inner is None:
            return None, text
        head, sep, tail = inner.partition(self.close_tag)
        if not sep:
            return inner.strip("\n"), ""  # cut off while reasoning
        return head.strip("\n"), tail.lstrip("\n")

    def partial(self, text: str) -> tuple[str, str | None]:
        """(certain reasoning prefix, certain content-so-far or None while still reasoning or undecided)."""
        head = text.lstrip()
        if len(head) < len(self.open_tag) and self.open_tag.startswith(head):
            return "", None  # empty, or may still become "<think>": undecided
        inner = self._inner(text)
        if inner is None:
            return "", text
        if self.close_tag in inner:
            head_text, _, tail = inner.partition(self.close_tag)
            return head_text.strip("\n"), tail.lstrip("\n")
        cut = len(inner) - partial_marker_len(inner, self.close_tag)
        return inner[:cut].lstrip("\n").rstrip("\n"), None


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3": Llama3JsonToolParser,
    "deepseek": DeepSeekToolParser,
    "none": ToolParser,
}


def infer_family(model_name: str, model_type: str = "") -> tuple[str, str]:
    """(tool parser, reasoning parser) for a model, from its family (rayrl/gateway/families.py)."""
    family = family_of(model_name, model_type)
    return family.tool_parser, family.reasoning_parser


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; choose from {sorted(TOOL_PARSERS)}") from None


def parse_completion(text: str, tool_parser: ToolParser, reasoning: ThinkReasoningParser | None) -> ParsedOutput:
    """Split reasoning (if a reasoning parser is set), then tool calls, from one finished completion."""
    thought = None
    if reasoning is not None:
        thought, text = reasoning.split(text)
    parsed = tool_parser.parse(text)
    parsed.reasoning = thought
    return parsed
