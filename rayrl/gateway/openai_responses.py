"""``POST /v1/responses``: the OpenAI Responses API, as Codex CLI uses it (stateless, streaming).

Input items become canonical chat messages: ``instructions`` and ``developer``/``system`` messages
are system messages; an assistant ``message`` item and the ``function_call`` items after it form one
assistant message with tool calls (that is how a turn's output is replayed, so it matches the recorded
response); ``function_call_output`` is a tool message; ``reasoning`` items are dropped (clients may or
may not echo them; the recorded response has no reasoning either, so routing is unaffected).
Non-function tools (``namespace``, ``web_search``, ``custom``, ...) are skipped: the model cannot call
them here. ``previous_response_id`` is refused: nothing is stored, clients replay the input. As in
the real API, a ``function_call_output`` must answer a ``function_call`` earlier in the input.

The stream emits the event sequence the API defines (created, in_progress, output items with their
content parts and deltas, function-call argument deltas, then ``response.completed`` with usage, or
``response.incomplete`` when ``max_output_tokens`` cut the generation); every event carries a
``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from rayrl.gateway import params as p
from rayrl.gateway.errors import RequestError
from rayrl.gateway.params import TurnSpec
from rayrl.gateway.render import normalize_message
from rayrl.gateway.streaming import SSEStream
from rayrl.gateway.tools import apply_tool_choice, responses_tool_choice, responses_tools
from rayrl.gateway.turns import Prepared, TurnResult

_IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"
_SKIPPED_ITEMS = {"reasoning", "item_reference", "web_search_call", "file_search_call", "compaction"}


def _text(content: Any, where: str) -> str:
    """Text of an item's content: a string or a list of text parts (input/output text, refusal)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of parts", param="input")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise RequestError(f"{where}.content[{i}] must be an object", param="input")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            text = part.get("text")
        elif kind == "refusal":
            text = part.get("refusal")
        elif kind in ("input_image", "input_file"):
            text = _IMAGE_PLACEHOLDER
        else:
            raise RequestError(f"{where}.content[{i}]: unsupported content part {kind!r}", param="input")
        if not isinstance(text, str):
            raise RequestError(f"{where}.content[{i}].text must be a string", param="input")
        parts.append(text)
    return "".join(parts)


def _string_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key} must be a string", param="input")
    return value


def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` + ``input`` as canonical OpenAI messages."""
    out: list[dict[str, Any]] = []
    called: set[str] = set()  # call ids of the function calls so far
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions must be a string", param="instructions")
        if instructions:
            out.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError("input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise RequestError(f"{where}.type must be a string", param="input")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role must be user, assistant, system or developer", param="input")
            out.append(normalize_message({"role": role, "content": _text(item.get("content"), where)}, i))
        elif kind in ("function_call", "custom_tool_call"):
            call_id = _string_field(item, "call_id", where)
            name = _string_field(item, "name", where)
            if kind == "function_call":
                arguments = _string_field(item, "arguments", where)
            else:
                arguments = json.dumps({"input": _string_field(item, "input", where)}, ensure_ascii=False)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            called.add(call_id)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _string_field(item, "call_id", where)
            if call_id not in called:
                raise RequestError(f"{where}: no tool call found for function call output with call_id "
                                   f"{call_id!r}", param="input")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where)
            out.append({"role": "tool", "content": text, "tool_call_id": call_id})
        elif kind in _SKIPPED_ITEMS:
            continue
        else:
            raise RequestError(f"{where}: unsupported input item type {kind!r}", param="input")
    if not out:
        raise RequestError("input holds no messages", param="input")
    return out


def parse_request(body: dict[str, Any], default_model: str) -> TurnSpec:
    if body.get("previous_response_id") is not None:
        raise RequestError("previous_response_id is not supported: responses are not stored; send the "
                           "whole input (store=false)", param="previous_response_id")
    choice = responses_tool_choice(body)
    tools = apply_tool_choice(responses_tools(body.get("tools")), choice)
    p.integer(body, "top_logprobs", 0, 20)  # checked as OpenAI does; alternatives are not returned
    return TurnSpec(
        messages=input_messages(body),
        tools=tools,
        tool_choice=choice,
        model=p.string(body, "model", default_model) or default_model,
        stream=p.boolean(body, "stream"),
        max_tokens=p.positive_int(body, "max_output_tokens"),
        temperature=p.number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=p.number(body, "top_p", 1e-9, 1.0, 1.0),
        id_prefix="call_",
        prompt_field="input",
    )


class _Ids:
    """Item ids of one response."""

    def __init__(self) -> None:
        self.response = "resp_" + uuid.uuid4().hex
        self.reasoning = "rs_" + uuid.uuid4().hex
        self.message = "msg_" + uuid.uuid4().hex


def _usage(result: TurnResult) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.cached_tokens},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def _reasoning_item(ids: _Ids, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": ids.reasoning, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(ids: _Ids, text: str, status: str = "completed") -> dict[str, Any]:
    done = status == "completed"
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
    return {"type": "message", "id": ids.message, "status": status, "role": "assistant", "content": content}


def _call_item(call: dict[str, Any], arguments: str | None = None, status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


def output_items(ids: _Ids, result: TurnResult) -> list[dict[str, Any]]:
    items = []
    if result.reasoning:
        items.append(_reasoning_item(ids, result.reasoning))
    if result.message["content"] or not result.tool_calls:
        items.append(_message_item(ids, result.message["content"]))
    items.extend(_call_item(c) for c in result.tool_calls)
    return items


def _response(ids: _Ids, spec: TurnSpec, body: dict[str, Any], created: int, status: str,
              output: list[dict[str, Any]], result: TurnResult | None = None) -> dict[str, Any]:
    incomplete = result is not None and result.finish == "length"
    return {
        "id": ids.response, "object": "response", "created_at": created, "model": spec.model,
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions") if isinstance(body.get("instructions"), str) else None,
        "output": output, "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "temperature": spec.temperature, "top_p": spec.top_p, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") if isinstance(body.get("tools"), list) else [],
        "max_output_tokens": spec.max_tokens, "store": False, "metadata": {},
        "text": {"format": {"type": "text"}},
        "usage": _usage(result) if result is not None else None,
    }


async def handle(gateway: Any, request: web.Request) -> web.StreamResponse:
    session = gateway.session_for(request)
    body, spec, prepared = await gateway.turn_request(request, session,
                                                      lambda body: parse_request(body, gateway.model_name))
    ids = _Ids()
    created = int(time.time())
    if not spec.stream:
        result = await gateway.turns.run(session, spec, prepared=prepared)
        status = "incomplete" if result.finish == "length" else "completed"
        return web.json_response(_response(ids, spec, body, created, status, output_items(ids, result), result))
    return await _stream(gateway, request, session, spec, prepared, body, ids, created)


class _EventStream:
    """Responses-API events with sequence numbers; output items opened lazily as deltas arrive."""

    def __init__(self, sse: SSEStream, ids: _Ids) -> None:
        self.sse = sse
        self.ids = ids
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items, in order
        self.open_kind: str | None = None  # "reasoning" | "message" while an item streams
        self.open_text = ""

    async def event(self, kind: str, **fields: Any) -> None:
        await self.sse.send({"type": kind, "sequence_number": self.seq, **fields}, event=kind)
        self.seq += 1

    @property
    def index(self) -> int:
        return len(self.items)

    async def _open(self, kind: str) -> None:
        if self.open_kind == kind:
            return
        await self.close_item()
        self.open_kind, self.open_text = kind, ""
        if kind == "reasoning":
            item = {"type": "reasoning", "id": self.ids.reasoning, "summary": [], "content": []}
            await self.event("response.output_item.added", output_index=self.index, item=item)
        else:
            await self.event("response.output_item.added", output_index=self.index,
                             item=_message_item(self.ids, "", status="in_progress"))
            await self.event("response.content_part.added", item_id=self.ids.message, output_index=self.index,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": []})

    async def reasoning(self, delta: str) -> None:
        await self._open("reasoning")
        self.open_text += delta
        await self.event("response.reasoning_text.delta", item_id=self.ids.reasoning, output_index=self.index,
                         content_index=0, delta=delta)

    async def content(self, delta: str) -> None:
        await self._open("message")
        self.open_text += delta
        await self.event("response.output_text.delta", item_id=self.ids.message, output_index=self.index,
                         content_index=0, delta=delta, logprobs=[])

    async def close_item(self) -> None:
        kind, text = self.open_kind, self.open_text
        if kind is None:
            return
        self.open_kind = None
        if kind == "reasoning":
            await self.event("response.reasoning_text.done", item_id=self.ids.reasoning, output_index=self.index,
                             content_index=0, text=text)
            item = _reasoning_item(self.ids, text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            await self.event("response.output_text.done", item_id=self.ids.message, output_index=self.index,
                             content_index=0, text=text, logprobs=[])
            await self.event("response.content_part.done", item_id=self.ids.message, output_index=self.index,
                             content_index=0, part=part)
            item = _message_item(self.ids, text)
        await self.event("response.output_item.done", output_index=self.index, item=item)
        self.items.append(item)

    async def function_call(self, call: dict[str, Any]) -> None:
        await self.close_item()
        item = _call_item(call)
        await self.event("response.output_item.added", output_index=self.index,
                         item=_call_item(call, arguments="", status="in_progress"))
        await self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=self.index,
                         delta=item["arguments"])
        await self.event("response.function_call_arguments.done", item_id=item["id"], output_index=self.index,
                         name=item["name"], arguments=item["arguments"])
        await self.event("response.output_item.done", output_index=self.index, item=item)
        self.items.append(item)


async def _stream(gateway: Any, request: web.Request, session: Any, spec: TurnSpec, prepared: Prepared,
                  body: dict[str, Any], ids: _Ids, created: int) -> web.StreamResponse:
    sse = SSEStream(request)
    events = _EventStream(sse, ids)
    await events.event("response.created", response=_response(ids, spec, body, created, "in_progress", []))
    await events.event("response.in_progress", response=_response(ids, spec, body, created, "in_progress", []))
    try:
        result = await gateway.turns.run(session, spec, events, prepared)
    except RequestError as err:
        gateway.stream_failed(request, err)
        failed = _response(ids, spec, body, created, "failed", events.items)
        failed["error"] = {"code": err.code or "server_error" if err.status >= 500 else "invalid_request",
                           "message": err.message}
        await events.event("response.failed", response=failed)
        return await sse.close()
    if not result.message["content"] and not result.tool_calls and events.open_kind != "message":
        await events.content("")  # a turn always has a message or a call: emit an empty message
    await events.close_item()
    for call in result.tool_calls:
        await events.function_call(call)
    status = "incomplete" if result.finish == "length" else "completed"
    final = _response(ids, spec, body, created, status, events.items, result)
    # generation cut off by max_output_tokens: the API ends such a stream with response.incomplete
    await events.event(f"response.{status}", response=final)
    return await sse.close()
