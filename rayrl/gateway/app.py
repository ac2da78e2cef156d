"""The gateway HTTP app: agents talk OpenAI Chat Completions; every call is recorded token for token.

``Gateway`` is a plain class: the TrajectoryManager actor hosts it, and ``python -m rayrl.gateway serve``
runs it standalone as a trace-capturing proxy. Each request is rendered to token ids, sent to an engine
as ``/generate`` with ``input_ids`` and log-probs on, parsed back into an assistant message and recorded
as a TurnRecord in its session's trajectory tree. Only unusual requests are logged (non-2xx or slow).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from typing import Any, Awaitable, Callable

import numpy as np
from aiohttp import web

from rayrl.config import GatewayConfig, TrajectoryConfig
from rayrl.gateway.errors import RequestError
from rayrl.gateway.parsers import ThinkReasoningParser, get_tool_parser, infer_family, parse_completion
from rayrl.gateway.render import ChatRenderer, normalize_messages, normalize_tools
from rayrl.gateway.sessions import Session, SessionInfo, SessionRegistry, versions_from
from rayrl.types import Sample, TurnRecord

logger = logging.getLogger("rayrl.gateway")

_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def _number(body: dict, key: str, lo: float, hi: float, default: float | None) -> float | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise RequestError(f"{key} must be a number in [{lo}, {hi}]", param=key)
    return float(value)


def _positive_int(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"{key} must be a positive integer", param=key)
    return value


def _stop_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= 16:
        return [s for s in value if s]
    raise RequestError("stop must be a string or a list of at most 16 strings", param="stop")


class Gateway:
    """OpenAI-compatible gateway over an engine router, with per-session trajectory trees.

    ``router`` needs ``async generate(session_key, input_ids, sampling_params, rid=None,
    return_logprob=True)`` returning an object with ``output_ids``, ``output_logprobs``, ``text``,
    ``finish_reason``, ``weight_version`` and ``versions`` (see rayrl.engines.router.Router).
    """

    def __init__(
        self,
        cfg: GatewayConfig,
        trajectory_cfg: TrajectoryConfig,
        tokenizer: Any,
        router: Any,
        model_name: str,
        *,
        context_length: int = 4096,
        chat_template: str | None = None,
        shard: int = 0,
        admin_token: str | None = None,
        model_type: str = "",
    ) -> None:
        self.cfg = cfg
        self.router = router
        self.model_name = model_name
        self.context_length = context_length
        tool_name, reasoning_name = infer_family(model_name, model_type)
        if cfg.tool_parser != "auto":
            tool_name = cfg.tool_parser
        if cfg.reasoning_parser != "auto":
            reasoning_name = cfg.reasoning_parser
        self.tool_parser = get_tool_parser(tool_name)
        self.reasoning_parser = ThinkReasoningParser() if reasoning_name == "think" else None
        self.renderer = ChatRenderer(
            tokenizer, self.tool_parser, chat_template, inject_tool_schemas=cfg.inject_tool_schemas
        )
        self.tokenizer = tokenizer
        self.sessions = SessionRegistry(trajectory_cfg, shard=shard)
        self.admin_token = admin_token or "rrl-admin-" + secrets.token_urlsafe(24)
        self.counters: dict[str, int] = {
            "requests": 0,
            "errors_4xx": 0,
            "errors_engine": 0,
            "tool_parse_errors": 0,
            "cumulative_hits": 0,
            "full_renders": 0,
            "generated_tokens": 0,
        }
        self.base_url = ""
        self._runner: web.AppRunner | None = None
        self.app = self._build_app()

    # -- lifecycle ---------------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=int(self.cfg.max_body_mb * 1024 * 1024), middlewares=[self._error_middleware]
        )
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/", self._health)
        app.router.add_post("/rayrl/sessions", self._http_open_session)
        app.router.add_post("/rayrl/sessions/{session_id}/finish", self._http_finish_session)
        return app

    async def start(self, host: str | None = None, port: int | None = None) -> str:
        """Serve on ``host:port`` (0 picks a free port); returns the base URL (…/v1)."""
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host or self.cfg.host, self.cfg.port if port is None else port)
        await site.start()
        sockets = site._server.sockets  # type: ignore[union-attr]
        bound_host, bound_port = sockets[0].getsockname()[:2]
        self.base_url = f"http://{bound_host}:{bound_port}/v1"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- sessions (in-process API used by the TrajectoryManager actor) -----------------------------

    def open_session(self, metadata: dict[str, Any] | None = None, session_id: str | None = None) -> SessionInfo:
        session = self.sessions.open(metadata, session_id)
        return SessionInfo(session.session_id, session.token, self.base_url)

    async def finish_session(
        self, session_id: str, reward: float, metadata: dict[str, Any] | None = None
    ) -> list[Sample]:
        """Finish a session: in-flight calls are cancelled first, then turns fold into samples."""
        session = self.sessions.get(session_id)
        session.finished = True
        for task in list(session.in_flight):
            task.cancel()
        if session.in_flight:
            await asyncio.gather(*session.in_flight, return_exceptions=True)
        return self.sessions.finish(session_id, reward, metadata)

    def session_stats(self, session_id: str) -> dict[str, Any]:
        return self.sessions.stats_of(session_id)

    # -- HTTP plumbing -----------------------------------------------------------------------------

    @web.middleware
    async def _error_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        started = time.monotonic()
        try:
            response = await handler(request)
        except RequestError as err:
            self.counters["errors_4xx"] += 1
            logger.info("%s %s -> %d: %s", request.method, request.path, err.status, err.message)
            return web.json_response(err.openai_body(), status=err.status)
        except web.HTTPException as err:
            if err.status >= 400:
                self.counters["errors_4xx"] += 1
                logger.info("%s %s -> %d", request.method, request.path, err.status)
                message = err.reason or "request error"
                if err.status == 413:
                    message = f"request body larger than {self.cfg.max_body_mb} MB"
                return web.json_response(RequestError(message, status=err.status).openai_body(), status=err.status)
            raise
        elapsed = time.monotonic() - started
        if elapsed > self.cfg.slow_request_log_s:
            logger.warning("slow request %s %s: %.1f s", request.method, request.path, elapsed)
        return response

    @staticmethod
    async def _json_body(request: web.Request) -> dict[str, Any]:
        try:
            raw = await request.read()
            body = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"request body is not valid JSON: {err}") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    @staticmethod
    def _bearer(request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        return request.headers.get("x-api-key")

    def _check_admin(self, request: web.Request) -> None:
        if not secrets.compare_digest((self._bearer(request) or "").encode(), self.admin_token.encode()):
            raise RequestError("admin token required", status=401)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "open_sessions": self.sessions.open_sessions})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "rayrl"}]}
        )

    async def _http_open_session(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        body = await self._json_body(request) if request.can_read_body else {}
        metadata = body.get("metadata", {})
        if not isinstance(metadata, dict):
            raise RequestError("metadata must be an object", param="metadata")
        info = self.open_session(metadata)
        return web.json_response({"session_id": info.session_id, "token": info.token, "base_url": info.base_url})

    async def _http_finish_session(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        body = await self._json_body(request)
        reward = body.get("reward", 0.0)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not np.isfinite(reward):
            raise RequestError("reward must be a finite number", param="reward")
        sid = request.match_info["session_id"]
        stats = self.sessions.stats_of(sid)
        samples = await self.finish_session(sid, float(reward))
        return web.json_response({"session_id": sid, "stats": stats, "samples": [s.to_dict() for s in samples]})

    # -- /v1/chat/completions ----------------------------------------------------------------------

    def _sampling_params(self, body: dict[str, Any], prompt_len: int) -> dict[str, Any]:
        max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
        max_tokens = max_tokens or self.cfg.default_max_tokens
        room = self.context_length - prompt_len
        if room < 1:
            raise RequestError(
                f"the prompt has {prompt_len} tokens; this model's context is {self.context_length}",
                code="context_length_exceeded",
            )
        params: dict[str, Any] = {
            "max_new_tokens": min(max_tokens, room),
            "temperature": _number(body, "temperature", 0.0, 2.0, 1.0),
            "top_p": _number(body, "top_p", 1e-9, 1.0, 1.0),
            "skip_special_tokens": True,
        }
        stops = _stop_list(body.get("stop"))
        if stops:
            params["stop"] = stops
        seed = body.get("seed")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise RequestError("seed must be an integer", param="seed")
            params["sampling_seed"] = seed
        for key in ("frequency_penalty", "presence_penalty"):
            if body.get(key) is not None:
                params[key] = _number(body, key, -2.0, 2.0, 0.0)
        return params

    def _prompt_ids(self, session: Session, messages: list[dict], tools: list | None) -> np.ndarray:
        if self.cfg.cumulative_token_mode:
            prev = session.history_match(messages)
            if prev is not None:
                ids = self.renderer.extend(prev, messages, tools)
                if ids is not None:
                    self.counters["cumulative_hits"] += 1
                    session.cumulative_hits += 1
                    return ids
        self.counters["full_renders"] += 1
        return self.renderer.render(messages, tools)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.counters["requests"] += 1
        session = self.sessions.by_token(self._bearer(request))
        if session.finished:
            raise RequestError("this session has finished; open a new one", status=409)
        body = await self._json_body(request)
        model = body.get("model", self.model_name)
        if not isinstance(model, str):
            raise RequestError("model must be a string", param="model")
        n = body.get("n", 1)
        if n != 1:
            raise RequestError("only n=1 is supported", param="n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be a boolean", param="stream")
        messages = normalize_messages(body.get("messages"))
        tools = normalize_tools(body.get("tools"))
        if body.get("tool_choice") == "none":
            tools = None
        want_logprobs = bool(body.get("logprobs", False))
        prompt_ids = self._prompt_ids(session, messages, tools)
        params = self._sampling_params(body, len(prompt_ids))

        session.requests += 1
        task = asyncio.current_task()
        session.in_flight.add(task)
        try:
            out = await self.router.generate(session.session_id, prompt_ids, params, return_logprob=True)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            session.failed_requests += 1
            self.counters["errors_engine"] += 1
            status = getattr(err, "status", None)
            if isinstance(status, int) and 400 <= status < 500:
                raise RequestError(f"the engine rejected the request: {err}") from None
            logger.warning("engine call failed for session %s: %s", session.session_id, err)
            raise RequestError(f"the inference engine is unavailable: {err}", status=503) from None
        finally:
            session.in_flight.discard(task)

        kind = (out.finish_reason or {}).get("type", "stop")
        parsed = parse_completion(out.text, self.tool_parser, self.reasoning_parser)
        if parsed.errors:
            self.counters["tool_parse_errors"] += 1
        response_message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            response_message["tool_calls"] = parsed.tool_calls
        elif parsed.errors:
            response_message["content"] = out.text  # unparseable tool call: hand back the raw text
        turn = TurnRecord(
            messages=messages,
            response_message=response_message,
            prompt_ids=prompt_ids,
            response_ids=out.output_ids,
            response_logprobs=out.output_logprobs,
            policy_version=versions_from(out.weight_version, out.versions),
            tools=tools,
            finish_reason=kind,
        )
        if not session.finished:
            session.tree.record_turn(turn)
            session.remember(turn)
        self.counters["generated_tokens"] += len(out.output_ids)

        finish = "tool_calls" if parsed.tool_calls else _FINISH.get(kind, "stop")
        wire_message: dict[str, Any] = {
            "role": "assistant",
            "content": response_message["content"] if (response_message["content"] or not parsed.tool_calls) else None,
        }
        if parsed.tool_calls:
            wire_message["tool_calls"] = parsed.tool_calls
        if parsed.reasoning is not None:
            wire_message["reasoning_content"] = parsed.reasoning
        choice: dict[str, Any] = {"index": 0, "message": wire_message, "finish_reason": finish, "logprobs": None}
        if want_logprobs:
            choice["logprobs"] = {"content": self._logprob_content(out.output_ids, out.output_logprobs)}
        usage = {
            "prompt_tokens": int(len(prompt_ids)),
            "completion_tokens": int(len(out.output_ids)),
            "total_tokens": int(len(prompt_ids) + len(out.output_ids)),
        }
        completion_id = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        if not stream:
            return web.json_response(
                {
                    "id": completion_id,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        return await self._stream_chat(request, completion_id, created, model, wire_message, finish, usage, body)

    def _logprob_content(self, ids: np.ndarray, logprobs: np.ndarray) -> list[dict[str, Any]]:
        out = []
        for tid, lp in zip(ids.tolist(), logprobs.tolist()):
            token = self.tokenizer.convert_ids_to_tokens(tid)
            out.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
        return out

    async def _stream_chat(
        self,
        request: web.Request,
        completion_id: str,
        created: int,
        model: str,
        message: dict[str, Any],
        finish: str,
        usage: dict[str, int],
        body: dict[str, Any],
    ) -> web.StreamResponse:
        """SSE in the Chat Completions chunk format (role, content, tool-call deltas, finish, [DONE])."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            obj = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
            }
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        await resp.write(chunk({"role": "assistant", "content": ""}))
        if message.get("reasoning_content"):
            await resp.write(chunk({"reasoning_content": message["reasoning_content"]}))
        if message.get("content"):
            await resp.write(chunk({"content": message["content"]}))
        for i, call in enumerate(message.get("tool_calls", [])):
            delta = {"tool_calls": [{"index": i, **call}]}
            await resp.write(chunk(delta))
        await resp.write(chunk({}, finish))
        if isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage"):
            obj = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
