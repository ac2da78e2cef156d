"""One LLM call, whatever API it came through: render, generate, parse, record.

The API modules (openai_chat, openai_responses, anthropic_messages) only translate: request body ->
:class:`TurnSpec`, :class:`TurnResult` -> their wire format. Everything that touches tokens is here,
once: the prompt is rendered with the model's chat template (or extended from the recorded tokens in
cumulative token mode), sent to an engine as token ids with log-probs on, parsed back into a canonical
assistant message and recorded as a TurnRecord in the session's trajectory tree.

Only a generation the engine finished normally is recorded. One the engine failed or cut (an engine
error or an unreachable engine, or a finish reason ``abort``: a request the engine failed alone, a
batch it aborted) is an error to the client (5xx; 4xx when the engine blames the request) and never
enters the tree as a normal turn: its tokens are not the model's answer. The gateway counts it once
per answer (``Gateway`` counts 5xx answers in the session's ``infra_errors``); here it is counted in
``errors_engine`` and the session's ``failed_requests``.

:meth:`TurnRunner.build` is pure (no counters, no session writes), so the gateway may run it in a
worker thread for a large request; :meth:`TurnRunner.count` then counts on the event loop, and admits
the call against ``gateway.max_turns_per_session``: a session past its cap gets a 400 in its API's
dialect (``turn_limit_exceeded``), before any byte is streamed, counted in ``turn_cap_refusals``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rayrl.config import GatewayConfig
from rayrl.engines.client import GenerateOutput
from rayrl.gateway.durations import DurationHistogram
from rayrl.gateway.errors import ContextLengthError, RequestError
from rayrl.gateway.params import TurnSpec
from rayrl.gateway.parsers import ParsedOutput, ThinkReasoningParser, ToolParser, parse_completion
from rayrl.gateway.render import ChatRenderer, PromptTooLong
from rayrl.gateway.sessions import Session, versions_from
from rayrl.gateway.streaming import DeltaTracker, TokenProgress
from rayrl.gateway.upstream import StreamingUpstream
from rayrl.gateway.work_lock import WorkLock
from rayrl.types import TurnRecord


class DeltaSink(Protocol):
    """Where a streaming API writes deltas as they become certain."""

    async def reasoning(self, delta: str) -> None: ...

    async def content(self, delta: str) -> None: ...


@dataclass
class TurnResult:
    """A finished call, in canonical form; each API formats it its own way."""

    message: dict[str, Any]  # canonical assistant message (what was recorded)
    reasoning: str | None
    finish: str  # stop | length | tool_calls
    matched_stop: str | None  # the stop string that ended generation, if any
    prompt_tokens: int
    output: GenerateOutput
    parse_errors: list[str] = field(default_factory=list)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return self.message.get("tool_calls", [])

    @property
    def completion_tokens(self) -> int:
        return int(len(self.output.output_ids))

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine served from its prefix cache (SGLang's ``meta_info.cached_tokens``)."""
        return max(0, min(int(self.output.meta_info.get("cached_tokens") or 0), self.prompt_tokens))


@dataclass
class Prepared:
    """A rendered prompt and its engine sampling parameters.

    ``forced``: text that starts the assistant turn to enforce a ``tool_choice`` (see
    :meth:`TurnRunner.forced_text`); its tokens end ``prompt_ids`` (they are prompt: the model did
    not choose them, so they are never trained on) and it is parsed together with the completion.
    """

    prompt_ids: np.ndarray
    params: dict[str, Any]
    forced: str = ""
    cumulative: bool = False  # built from a recorded turn's tokens (cumulative token mode)
    history: TurnRecord | None = None  # the remembered turn whose messages + response start the request's


class TurnRunner:
    """Render -> engine -> parse -> record, with the gateway's counters."""

    def __init__(
        self,
        cfg: GatewayConfig,
        renderer: ChatRenderer,
        tool_parser: ToolParser,
        reasoning_parser: ThinkReasoningParser | None,
        router: Any,
        upstream: StreamingUpstream,
        context_length: int,
        counters: dict[str, int],
        cpu: WorkLock | None = None,
    ) -> None:
        """``cpu``: the gateway's lock for pieces of request work (app.py); parsing and recording an
        answer is one such piece."""
        self.cfg = cfg
        self.cpu = cpu or WorkLock()
        self.renderer = renderer
        self.vocab_size = len(renderer.tokenizer)  # once: len() of a fast tokenizer costs tens of ms
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.router = router
        self.upstream = upstream
        self.context_length = context_length
        self.counters = counters
        counters.setdefault("turn_cap_refusals", 0)
        self.record_times = DurationHistogram()  # each turn's record into its session's tree (durations.py)

    # -- prompt ------------------------------------------------------------------------------------

    @property
    def prompt_limit(self) -> int:
        """The longest prompt accepted: the context less one token to generate, or the configured limit."""
        limit = self.context_length - 1
        return min(limit, self.cfg.max_prompt_tokens) if self.cfg.max_prompt_tokens > 0 else limit

    def too_long(self, tokens: int, spec: TurnSpec, exact: bool = True) -> ContextLengthError:
        by_config = 0 < self.cfg.max_prompt_tokens < self.context_length - 1
        maximum = self.cfg.max_prompt_tokens if by_config else self.context_length
        return ContextLengthError(tokens, maximum, exact=exact, by_config=by_config, param=spec.prompt_field)

    def prompt_ids(self, session: Session, spec: TurnSpec) -> tuple[np.ndarray, bool, TurnRecord | None]:
        """Cumulative token mode when the history matches a recorded turn exactly, else a full render;
        True when cumulative; the matched turn (None when none matched). A prompt longer than
        :attr:`prompt_limit` is a ContextLengthError."""
        prev = None
        try:
            if self.cfg.cumulative_token_mode:
                prev = session.history_match(spec.messages)
                if prev is not None:
                    ids = self.renderer.extend(prev, spec.messages, spec.tools, self.prompt_limit)
                    if ids is not None:
                        return ids, True, prev
            return self.renderer.render(spec.messages, spec.tools, self.prompt_limit), False, prev
        except PromptTooLong as err:
            raise self.too_long(err.at_least, spec, exact=err.exact) from None

    def max_new_tokens(self, spec: TurnSpec, prompt_len: int) -> int:
        if prompt_len > self.prompt_limit:
            raise self.too_long(prompt_len, spec)
        room = self.context_length - prompt_len
        wanted = spec.max_tokens or self.cfg.default_max_tokens
        if self.cfg.max_tokens_cap > 0:
            wanted = min(wanted, self.cfg.max_tokens_cap)
        return min(wanted, room)

    # -- the call ----------------------------------------------------------------------------------

    def build(self, session: Session, spec: TurnSpec) -> Prepared:
        """Render and size the prompt, without side effects (see :meth:`prepare`)."""
        if session.finished:
            raise RequestError("this session has finished; open a new one", status=409)
        served = self.cfg.served_model_names
        if served and spec.model not in served:
            raise RequestError(f"model {spec.model!r} is not served here (served: {', '.join(served)})",
                               status=404, param="model", code="model_not_found")
        if spec.logit_bias and max(spec.logit_bias) >= self.vocab_size:
            raise RequestError(f"logit_bias: token id {max(spec.logit_bias)} is not in the vocabulary "
                               f"[0, {self.vocab_size})", param="logit_bias")
        prompt_ids, cumulative, history = self.prompt_ids(session, spec)
        forced = self.forced_text(spec)
        if forced:
            prompt_ids = np.concatenate([prompt_ids, self.renderer.tokenize(forced)]).astype(np.int32, copy=False)
        params = spec.sampling_params(self.max_new_tokens(spec, len(prompt_ids)))
        if spec.tools and not spec.tool_choice.parallel and self.tool_parser.call_end:
            # at most one call: generation stops where the first call closes
            params["stop"] = [*params.get("stop", []), self.tool_parser.call_end]
        return Prepared(prompt_ids, params, forced, cumulative, history)

    def count(self, session: Session, prepared: Prepared) -> None:
        """Admit the call against the session's turn cap, and count how its prompt was built (on the event
        loop: counters are not shared with threads, and no await splits the check from the increment)."""
        cap = self.cfg.max_turns_per_session
        if cap and session.admitted >= cap:
            session.turn_cap_refusals += 1
            self.counters["turn_cap_refusals"] += 1
            raise RequestError(f"this session has used its {cap} LLM calls (gateway.max_turns_per_session); "
                               "no more are accepted", code="turn_limit_exceeded")
        session.admitted += 1
        if prepared.cumulative:
            self.counters["cumulative_hits"] += 1
            session.cumulative_hits += 1
        else:
            self.counters["full_renders"] += 1

    def prepare(self, session: Session, spec: TurnSpec) -> Prepared:
        """Render and size the prompt, and count it. Handlers call this (or build + count) before
        sending any byte, so a bad request (template error, context overflow) is still an HTTP 4xx,
        not an in-stream error."""
        prepared = self.build(session, spec)
        self.count(session, prepared)
        return prepared

    def forced_text(self, spec: TurnSpec) -> str:
        """The forced start of the assistant turn for a ``tool_choice`` that requires a call ("" when
        none is required or the parser family cannot be forced). Under a reasoning template whose
        generation prompt opens ``<think>``, the forced text closes the (empty) reasoning first."""
        choice = spec.tool_choice
        if not spec.tools or not choice.forces_call:
            return ""
        prefix = self.tool_parser.forced_prefix(choice.name if choice.mode == "function" else None)
        if not prefix:
            return ""
        if self.reasoning_parser is not None and self.reasoning_parser.opened_in_prompt:
            prefix = self.reasoning_parser.close_tag + "\n\n" + prefix
        return prefix

    async def run(
        self, session: Session, spec: TurnSpec, sink: DeltaSink | None = None, prepared: Prepared | None = None,
        progress: TokenProgress | None = None,
    ) -> TurnResult:
        """One call. With a ``sink`` the engine streams and certain deltas go to the sink as they come;
        ``progress`` (streaming only) is kept up to date with the tokens generated so far, before each
        delta is sent, when the router reports them with the text."""
        prepared = prepared or self.prepare(session, spec)
        if session.finished:
            raise RequestError("this session has finished; open a new one", status=409)
        prompt_ids, params, forced = prepared.prompt_ids, prepared.params, prepared.forced
        session.requests += 1
        task = asyncio.current_task()
        session.in_flight.add(task)
        tracker = DeltaTracker(self.tool_parser, self.reasoning_parser) if sink is not None else None
        try:
            if sink is None:
                out = await self.router.generate(session.session_id, prompt_ids, params)
            else:

                async def on_text(text: str, output_ids: Any = None, output_logprobs: Any = None) -> None:
                    def piece() -> tuple[str, str]:
                        if progress is not None and output_ids is not None and output_logprobs is not None:
                            progress.update(output_ids, output_logprobs)
                        return tracker.feed(forced + text)

                    # a piece of work; the sends follow it (never wait on a client locked)
                    d_reasoning, d_content = await self.cpu.run(piece)
                    if d_reasoning:
                        await sink.reasoning(d_reasoning)
                    if d_content:
                        await sink.content(d_content)

                out = await self.upstream.generate(session.session_id, prompt_ids, params, on_text)
        except asyncio.CancelledError:
            self.counters["client_disconnects"] += 1
            raise
        except (ConnectionError, RequestError):
            raise
        except Exception as err:
            raise self._engine_failure(session, getattr(err, "status", None),
                                       f"the inference engine is unavailable: {err}", str(err)) from None
        finally:
            session.in_flight.discard(task)
        reason = out.finish_reason or {}
        if reason.get("type") == "abort":  # failed or cut by the engine: not the model's answer
            raise self._engine_failure(session, reason.get("status_code"),
                                       f"the engine aborted the generation: {reason.get('message') or 'aborted'}",
                                       str(reason.get("message")))

        result = await self.cpu.run(lambda: self._finish(session, spec, prompt_ids, out, forced, prepared.history))
        if progress is not None:
            progress.update(out.output_ids.tolist(), out.output_logprobs.tolist())
        if tracker is not None:
            d_reasoning, d_content = tracker.finish(
                ParsedOutput(content=result.message["content"], reasoning=result.reasoning),
                result.message["content"],
            )
            if tracker.mismatch:
                self.counters["stream_mismatches"] += 1
            if d_reasoning:
                await sink.reasoning(d_reasoning)
            if d_content:
                await sink.content(d_content)
        return result

    def _engine_failure(self, session: Session, status: Any, message: str, detail: str) -> RequestError:
        """The error for a call the engine failed: 400 when the engine blamed the request, else a 5xx
        (the engine's status when it gave one, 503 otherwise). Nothing is recorded."""
        session.failed_requests += 1
        self.counters["errors_engine"] += 1
        if isinstance(status, int) and not isinstance(status, bool) and 400 <= status < 500:
            return RequestError(f"the engine rejected the request: {detail}")
        code = status if isinstance(status, int) and not isinstance(status, bool) and 500 <= status < 600 else 503
        return RequestError(message, status=code)

    def _finish(self, session: Session, spec: TurnSpec, prompt_ids: np.ndarray, out: GenerateOutput,
                forced: str = "", history: TurnRecord | None = None) -> TurnResult:
        """Parse the (forced start +) completion and record the turn (unless the session finished meanwhile).

        A forced call the model did not complete parseably is answered as plain text (the forced start
        included), never as an error: the client sees what the model wrote; ``tool_choice_unmet``
        counts it.
        """
        reason = out.finish_reason or {}
        kind = reason.get("type", "stop")
        parsed = parse_completion(forced + out.text, self.tool_parser, self.reasoning_parser)
        if parsed.errors:
            self.counters["tool_parse_errors"] += 1
        if spec.tools and spec.tool_choice.forces_call and not parsed.tool_calls:
            self.counters["tool_choice_unmet"] += 1
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = [
                {**c, "id": spec.id_prefix + uuid.uuid4().hex[:24]} for c in parsed.tool_calls
            ]
        turn = TurnRecord(
            messages=spec.messages,
            response_message=message,
            prompt_ids=prompt_ids,
            response_ids=out.output_ids,
            response_logprobs=out.output_logprobs,
            policy_version=versions_from(out.weight_version, out.versions),
            tools=spec.tools,
            finish_reason=kind,
        )
        finish = "tool_calls" if parsed.tool_calls else ("length" if kind == "length" else "stop")
        if not session.finished and session.record:
            started = time.perf_counter()
            session.tree.record_turn(turn)
            session.remember(turn, history)
            self.record_times.add(time.perf_counter() - started)
            session.tool_turns += 1 if spec.tools else 0
            session.tool_parse_errors += 1 if parsed.errors else 0
            session.length_turns += 1 if kind == "length" else 0
            session.last_finish = finish
        self.counters["generated_tokens"] += len(out.output_ids)
        matched = reason.get("matched")
        return TurnResult(
            message=message,
            reasoning=parsed.reasoning,
            finish=finish,
            matched_stop=matched if isinstance(matched, str) else None,
            prompt_tokens=int(len(prompt_ids)),
            output=out,
            parse_errors=parsed.errors,
        )

