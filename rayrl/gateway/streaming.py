"""Server-sent events and incremental parsing, shared by the three streaming APIs.

:class:`DeltaTracker` turns the engine's cumulative text into reasoning and content deltas that are
certain (see the parsers' ``safe_content``/``partial``): text that may still turn out to be a
``<tool_call>`` marker, a ``</think>`` tag, trailing whitespace before a tool call or half of a UTF-8
character is held back. At the end, :meth:`DeltaTracker.finish` sends what is left of the final
parse, so the concatenated deltas equal the recorded message exactly; tool calls are emitted only
then, once parsed.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from aiohttp import web

from rayrl.gateway.parsers import ParsedOutput, ThinkReasoningParser, ToolParser

_REPLACEMENT = "\ufffd"  # what a detokenizer shows for half a UTF-8 character


class DeltaTracker:
    """What part of a growing completion has been sent as reasoning and as content."""

    def __init__(self, tool_parser: ToolParser, reasoning_parser: ThinkReasoningParser | None) -> None:
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.reasoning_sent = ""
        self.content_sent = ""
        self.mismatch = False  # the final parse did not extend what was streamed (counted, rare)

    def _advance(self, which: str, certain: str) -> str:
        sent = self.reasoning_sent if which == "reasoning" else self.content_sent
        if len(certain) <= len(sent) or not certain.startswith(sent):
            return ""
        if which == "reasoning":
            self.reasoning_sent = certain
        else:
            self.content_sent = certain
        return certain[len(sent) :]

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for the cumulative ``text`` of an unfinished completion."""
        text = text.rstrip(_REPLACEMENT)
        if self.reasoning_parser is not None:
            reasoning, body = self.reasoning_parser.partial(text)
        else:
            reasoning, body = "", text
        d_reasoning = self._advance("reasoning", reasoning) if reasoning else ""
        d_content = self._advance("content", self.tool_parser.safe_content(body)) if body else ""
        return d_reasoning, d_content

    def finish(self, parsed: ParsedOutput, content: str) -> tuple[str, str]:
        """The remaining (reasoning, content) deltas once the final parse is known."""
        out = []
        for which, final in (("reasoning", parsed.reasoning or ""), ("content", content)):
            sent = self.reasoning_sent if which == "reasoning" else self.content_sent
            if not final.startswith(sent):
                self.mismatch = True
                out.append("")
                continue
            out.append(self._advance(which, final) if len(final) > len(sent) else "")
        return out[0], out[1]


class TokenProgress:
    """The token ids and log-probs of a streaming call so far, and how many have been sent.

    Chat Completions with ``logprobs`` sends each content chunk with the log-probs of the tokens
    generated since the previous content chunk, and the rest (tool-call text, the end token) with the
    finish chunk: over a whole stream, every output token's log-prob is sent exactly once, in order,
    the same list a non-streaming answer carries.
    """

    def __init__(self) -> None:
        self.ids: Sequence[int] = ()
        self.logprobs: Sequence[float] = ()
        self.sent = 0

    def update(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """The cumulative ids/log-probs so far (kept by reference: called once per streamed chunk, so
        copying would be quadratic in the completion's length)."""
        self.ids, self.logprobs = ids, logprobs

    def take(self) -> tuple[list[int], list[float]]:
        """The tokens not sent yet (marked sent)."""
        n = min(len(self.ids), len(self.logprobs))
        start, self.sent = self.sent, max(self.sent, n)
        return [int(i) for i in self.ids[start:n]], [float(x) for x in self.logprobs[start:n]]


class SSEStream:
    """A ``text/event-stream`` response; ``send`` raises ConnectionResetError once the client is gone."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
        )
        self.started = False

    async def start(self) -> None:
        if not self.started:
            await self.response.prepare(self.request)
            self.started = True

    async def send(self, data: dict[str, Any] | str, event: str | None = None) -> None:
        await self.start()
        payload = data if isinstance(data, str) else json.dumps(data)  # ASCII: lone surrogates stay safe
        head = f"event: {event}\n" if event else ""
        await self.response.write(f"{head}data: {payload}\n\n".encode())

    async def close(self) -> web.StreamResponse:
        await self.start()
        await self.response.write_eof()
        return self.response
