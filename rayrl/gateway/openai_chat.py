"""``POST /v1/chat/completions``: OpenAI Chat Completions, streaming and not.

Streaming is incremental: content deltas go out as the engine generates (held back only while they
might still be a tool-call marker, see streaming.DeltaTracker); tool calls go out at the end, once
parsed, one ``tool_calls`` delta per call (name first, then the arguments), then the finish chunk,
an optional usage chunk (``stream_options.include_usage``) and ``[DONE]``. With ``logprobs``, each
content chunk carries the log-probs of its tokens and the finish chunk the rest (streaming.TokenProgress).

Validation follows OpenAI's: numbers in range (params.py), ``logit_bias`` passed to the engine, and a
``tool`` message must answer a call of the assistant message before it (``tool_call_id`` among its
``tool_calls``), as the real API requires.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from aiohttp import web

from rayrl.gateway import answers
from rayrl.gateway import params as p
from rayrl.gateway.errors import RequestError
from rayrl.gateway.params import TurnSpec
from rayrl.gateway.render import normalize_messages
from rayrl.gateway.streaming import SSEStream, TokenProgress
from rayrl.gateway.tools import apply_tool_choice, chat_tool_choice, chat_tools
from rayrl.gateway.turns import Prepared, TurnResult


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Each tool message answers a call of the assistant message it follows (only tool messages between)."""
    calls: set[str] | None = None  # ids called by the assistant message the current tool run answers
    for i, msg in enumerate(messages):
        if msg["role"] != "tool":
            calls = {c["id"] for c in msg.get("tool_calls", [])} if msg["role"] == "assistant" else None
            calls = calls or None
            continue
        if calls is None:
            raise RequestError(f"messages[{i}]: a message with role 'tool' must be a response to a preceding "
                               "message with 'tool_calls'", param=f"messages[{i}].role")
        if msg["tool_call_id"] not in calls:
            raise RequestError(f"messages[{i}].tool_call_id: {msg['tool_call_id']!r} is not the id of any of the "
                               "preceding assistant message's tool_calls", param=f"messages[{i}].tool_call_id")


def parse_request(body: dict[str, Any], default_model: str) -> TurnSpec:
    """A Chat Completions body as a TurnSpec (400 naming the field on anything malformed)."""
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise RequestError("only n=1 is supported", param="n")
    choice = chat_tool_choice(body)
    tools = apply_tool_choice(chat_tools(body.get("tools")), choice)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError("logprobs must be a boolean", param="logprobs")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    penalties = {k: p.number(body, k, -2.0, 2.0, None) for k in ("frequency_penalty", "presence_penalty")}
    p.integer(body, "top_logprobs", 0, 20)  # checked as OpenAI does; alternatives are not returned
    messages = normalize_messages(body.get("messages"))
    check_tool_messages(messages)
    return TurnSpec(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        model=p.string(body, "model", default_model) or default_model,
        stream=p.boolean(body, "stream"),
        max_tokens=p.positive_int(body, "max_completion_tokens") or p.positive_int(body, "max_tokens"),
        temperature=p.number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=p.number(body, "top_p", 1e-9, 1.0, 1.0),
        stop=p.stop_list(body.get("stop")),
        seed=p.seed(body),
        frequency_penalty=penalties["frequency_penalty"],
        presence_penalty=penalties["presence_penalty"],
        logit_bias=p.logit_bias(body),
        want_logprobs=bool(logprobs),
        id_prefix="call_",
    )


def _usage(result: TurnResult) -> dict[str, Any]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def _wire_message(result: TurnResult) -> dict[str, Any]:
    content = result.message["content"]
    message: dict[str, Any] = {"role": "assistant", "content": content if (content or not result.tool_calls) else None}
    if result.tool_calls:
        message["tool_calls"] = result.tool_calls
    if result.reasoning is not None:
        message["reasoning_content"] = result.reasoning
    return message


async def handle(gateway: Any, request: web.Request) -> web.StreamResponse:
    session = gateway.session_for(request)
    body, spec, prepared = await gateway.turn_request(request, session,
                                                      lambda body: parse_request(body, gateway.model_name))
    completion_id = "chatcmpl-" + os.urandom(16).hex()  # as opaque as a uuid4's hex, a sixth of its cost
    created = int(time.time())
    if not spec.stream:
        result = await gateway.turns.run(session, spec, prepared=prepared)
        choice: dict[str, Any] = {
            "index": 0,
            "message": _wire_message(result),
            "finish_reason": result.finish,
            "logprobs": {"content": gateway.logprob_content(result.output)} if spec.want_logprobs else None,
        }
        answer = {"id": completion_id, "object": "chat.completion", "created": created, "model": spec.model,
                  "choices": [choice], "usage": _usage(result)}
        if spec.want_logprobs and not np.isfinite(result.output.output_logprobs).all():
            return web.json_response(answer)  # -inf/NaN log-probs written as before (orjson writes null)
        return answers.json_response(answer)
    return await _stream(gateway, request, session, spec, prepared, body, completion_id, created)


async def _stream(
    gateway: Any, request: web.Request, session: Any, spec: TurnSpec, prepared: Prepared, body: dict[str, Any],
    completion_id: str, created: int,
) -> web.StreamResponse:
    sse = SSEStream(request)
    progress = TokenProgress() if spec.want_logprobs else None

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": spec.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

    def new_logprobs() -> dict[str, Any] | None:
        """The log-probs of the tokens generated since the last content chunk (see TokenProgress)."""
        if progress is None:
            return None
        return {"content": gateway.logprob_entries(*progress.take()), "refusal": None}

    class Sink:
        async def reasoning(self, delta: str) -> None:
            await sse.send(chunk({"reasoning_content": delta}))

        async def content(self, delta: str) -> None:
            await sse.send(chunk({"content": delta}, logprobs=new_logprobs()))

    # The role chunk goes out before generation starts, as OpenAI does; errors after this point can
    # only be reported inside the stream.
    await sse.send(chunk({"role": "assistant", "content": ""}))
    try:
        result = await gateway.turns.run(session, spec, Sink(), prepared, progress)
    except RequestError as err:
        gateway.stream_failed(request, err)
        await sse.send(err.openai_body())
        await sse.send("[DONE]")
        return await sse.close()
    for i, call in enumerate(result.tool_calls):
        fn = call["function"]
        head = {"index": i, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}
        await sse.send(chunk({"tool_calls": [head]}))
        await sse.send(chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}))
    await sse.send(chunk({}, result.finish, new_logprobs()))
    options = body.get("stream_options") or {}
    if options.get("include_usage"):
        await sse.send({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                        "model": spec.model, "choices": [], "usage": _usage(result)})
    await sse.send("[DONE]")
    return await sse.close()
