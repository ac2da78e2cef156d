"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: the Anthropic Messages API (Claude Code).

Conversion to canonical OpenAI messages: ``system`` (a string or text blocks) becomes a leading
system message; a ``role: "system"`` message inside ``messages`` (Claude Code's mid-conversation
system beta) stays a system message where it is; assistant ``text`` + ``tool_use`` blocks become one
assistant message with tool calls (``input`` serialised the way the gateway serialises parsed
arguments, so an echoed turn matches the recorded one); ``thinking`` blocks are dropped (the recorded
message has no reasoning either); ``tool_result`` blocks become tool messages, other user text a user
message. ``cache_control``, ``metadata``, ``output_config``, ``context_management`` and
``thinking`` (any type, ``adaptive`` included) are accepted and have no effect. Server tools
(``web_search_*``, ``bash_*``, ... i.e. any tool with a ``type`` other than ``custom``) are skipped.

Validation follows the real API's: ``max_tokens`` is required, ``temperature`` is in [0, 1], and tool
blocks pair up: every ``tool_result`` answers a ``tool_use`` of the assistant message just before it,
and every ``tool_use`` of an assistant message (but the last message) is answered in the next message.
Errors use Anthropic's body shape; streaming errors after ``message_start`` are an ``error`` event.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from rayrl.gateway import params as p
from rayrl.gateway.errors import RequestError
from rayrl.gateway.params import TurnSpec
from rayrl.gateway.render import PromptTooLong
from rayrl.gateway.streaming import SSEStream
from rayrl.gateway.tools import anthropic_tool_choice, anthropic_tools, apply_tool_choice
from rayrl.gateway.turns import Prepared, TurnResult

_IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"
_DROPPED_BLOCKS = {"thinking", "redacted_thinking"}


def _block_text(block: dict[str, Any], where: str) -> str:
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{where}.text must be a string")
        return text
    if kind in ("image", "document"):
        return _IMAGE_PLACEHOLDER
    raise RequestError(f"{where}: unsupported content block type {kind!r}")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """Content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"{where}.content[{i}] must be an object with a string type")
    return content


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(_block_text(b, f"{where}.content[{i}]") for i, b in enumerate(_blocks(content, where)))


def system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    blocks = _blocks(system, "system")
    return "\n\n".join(_block_text(b, f"system[{i}]") for i, b in enumerate(blocks))


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        kind = block["type"]
        if kind in _DROPPED_BLOCKS:
            continue
        if kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not name:
                raise RequestError(f"{where}.content[{i}]: tool_use needs string id and name")
            if not isinstance(args, dict):
                raise RequestError(f"{where}.content[{i}].input must be an object")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        else:
            texts.append(_block_text(block, f"{where}.content[{i}]"))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        kind = block["type"]
        if kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise RequestError(f"{where}.content[{i}].tool_use_id must be a string")
            out.append({"role": "tool", "content": _tool_result_text(block, f"{where}.content[{i}]"),
                        "tool_call_id": call_id})
        elif kind in _DROPPED_BLOCKS:
            continue
        else:
            text = _block_text(block, f"{where}.content[{i}]")
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
    return out


def _check_tool_results(blocks: list[dict[str, Any]], called: list[str], where: str) -> None:
    """The real API's pairing: the ``tool_result`` blocks of the message after an assistant message with
    ``tool_use`` blocks answer exactly those calls (``called``; empty when that message made none)."""
    answered = set()
    for j, block in enumerate(blocks):
        if block["type"] != "tool_result":
            continue
        call_id = block.get("tool_use_id")
        if call_id not in called:
            raise RequestError(f"{where}.content[{j}]: unexpected `tool_use_id` found in `tool_result` blocks: "
                               f"{call_id}. Each `tool_result` block must have a corresponding `tool_use` block "
                               "in the previous message.")
        answered.add(call_id)
    missing = [c for c in called if c not in answered]
    if missing:
        raise RequestError(f"{where}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                           f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` "
                           "block in the next message.")


def canonical_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = system_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    called: list[str] = []  # tool_use ids of the last assistant message, until the next message answers them
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(f"{where} must be an object")
        role = msg.get("role")
        blocks = _blocks(msg.get("content"), where)
        if role in ("assistant", "user"):
            _check_tool_results(blocks, called, where)
            called = [b["id"] for b in blocks if b["type"] == "tool_use" and isinstance(b.get("id"), str)]
        if role == "assistant":
            out.append(_assistant(blocks, where))
        elif role == "user":
            out.extend(_user(blocks, where))
        elif role == "system":
            out.append({"role": "system", "content": "".join(
                _block_text(b, f"{where}.content[{j}]") for j, b in enumerate(blocks))})
        else:
            raise RequestError(f"{where}.role must be user, assistant or system")
    return out


def parse_request(body: dict[str, Any], default_model: str) -> TurnSpec:
    thinking = body.get("thinking")
    if thinking is not None and not isinstance(thinking, dict):
        raise RequestError("thinking must be an object", param="thinking")
    choice = anthropic_tool_choice(body)
    tools = apply_tool_choice(anthropic_tools(body.get("tools")), choice)
    if body.get("max_tokens") is None:
        raise RequestError("max_tokens: Field required", param="max_tokens")
    return TurnSpec(
        messages=canonical_messages(body),
        tools=tools,
        tool_choice=choice,
        model=p.string(body, "model", default_model) or default_model,
        stream=p.boolean(body, "stream"),
        max_tokens=p.positive_int(body, "max_tokens"),
        temperature=p.number(body, "temperature", 0.0, 1.0, 1.0),
        top_p=p.number(body, "top_p", 1e-9, 1.0, 1.0),
        top_k=p.positive_int(body, "top_k"),
        stop=p.stop_list(body.get("stop_sequences"), "stop_sequences"),
        id_prefix="toolu_",
    )


def _stop_reason(result: TurnResult, spec: TurnSpec) -> tuple[str, str | None]:
    if result.finish == "tool_calls":
        return "tool_use", None
    if result.finish == "length":
        return "max_tokens", None
    if result.matched_stop is not None and result.matched_stop in spec.stop:
        return "stop_sequence", result.matched_stop
    return "end_turn", None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": json.loads(fn["arguments"])}


def _usage(input_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, Any]:
    """Anthropic's split: ``input_tokens`` excludes what was read from the (engine's prefix) cache."""
    return {"input_tokens": input_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


async def handle(gateway: Any, request: web.Request) -> web.StreamResponse:
    session = gateway.session_for(request)
    body, spec, prepared = await gateway.turn_request(request, session,
                                                      lambda body: parse_request(body, gateway.model_name))
    message_id = "msg_" + uuid.uuid4().hex
    if not spec.stream:
        result = await gateway.turns.run(session, spec, prepared=prepared)
        content: list[dict[str, Any]] = []
        if result.reasoning:
            content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
        if result.message["content"] or not result.tool_calls:
            content.append({"type": "text", "text": result.message["content"]})
        content.extend(_tool_use(c) for c in result.tool_calls)
        stop_reason, stop_sequence = _stop_reason(result, spec)
        return web.json_response({
            "id": message_id, "type": "message", "role": "assistant", "model": spec.model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens),
        })
    return await _stream(gateway, request, session, spec, prepared, message_id)


class _BlockStream:
    """Anthropic stream events; content blocks opened lazily and closed in order."""

    def __init__(self, sse: SSEStream) -> None:
        self.sse = sse
        self.index = -1
        self.open_kind: str | None = None

    async def event(self, kind: str, **fields: Any) -> None:
        await self.sse.send({"type": kind, **fields}, event=kind)

    async def _open(self, kind: str, block: dict[str, Any]) -> None:
        if self.open_kind == kind:
            return
        await self.close_block()
        self.index += 1
        self.open_kind = kind
        await self.event("content_block_start", index=self.index, content_block=block)

    async def reasoning(self, delta: str) -> None:
        await self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        await self.event("content_block_delta", index=self.index, delta={"type": "thinking_delta", "thinking": delta})

    async def content(self, delta: str) -> None:
        await self._open("text", {"type": "text", "text": ""})
        if delta:
            await self.event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": delta})

    async def close_block(self) -> None:
        if self.open_kind is None:
            return
        if self.open_kind == "thinking":
            await self.event("content_block_delta", index=self.index,
                             delta={"type": "signature_delta", "signature": ""})
        await self.event("content_block_stop", index=self.index)
        self.open_kind = None

    async def tool_use(self, call: dict[str, Any]) -> None:
        await self.close_block()
        self.index += 1
        block = {**_tool_use(call), "input": {}}
        await self.event("content_block_start", index=self.index, content_block=block)
        await self.event("content_block_delta", index=self.index,
                         delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
        await self.event("content_block_stop", index=self.index)


async def _stream(gateway: Any, request: web.Request, session: Any, spec: TurnSpec, prepared: Prepared,
                  message_id: str) -> web.StreamResponse:
    sse = SSEStream(request)
    blocks = _BlockStream(sse)
    await blocks.event("message_start", message={
        "id": message_id, "type": "message", "role": "assistant", "model": spec.model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": _usage(len(prepared.prompt_ids), 0)})
    await blocks.event("ping")
    try:
        result = await gateway.turns.run(session, spec, blocks, prepared)
    except RequestError as err:
        gateway.stream_failed(request, err)
        await sse.send(err.anthropic_body(), event="error")
        return await sse.close()
    if blocks.index < 0 and not result.tool_calls:
        await blocks.content("")  # an empty answer is still one (empty) text block
    await blocks.close_block()
    for call in result.tool_calls:
        await blocks.tool_use(call)
    stop_reason, stop_sequence = _stop_reason(result, spec)
    await blocks.event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                       usage=_usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens))
    await blocks.event("message_stop")
    return await sse.close()


async def count_tokens(gateway: Any, request: web.Request) -> web.Response:
    """The prompt's exact length, counted up to the gateway's prompt limit (a longer prompt gets the
    prompt-too-long error, without being tokenized in full)."""
    gateway.session_for(request)
    body = await gateway.json_body(request)

    def count() -> int:
        messages = canonical_messages(body)
        tools = anthropic_tools(body.get("tools"))
        limit = gateway.turns.prompt_limit
        try:
            return gateway.renderer.count_tokens(messages, tools, limit)
        except PromptTooLong as err:
            spec = TurnSpec(messages=messages, tools=tools, model=gateway.model_name)
            raise gateway.turns.too_long(err.at_least, spec, exact=err.exact) from None

    return web.json_response({"input_tokens": await gateway.off_loop(request, count)})
