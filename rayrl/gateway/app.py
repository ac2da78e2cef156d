"""The gateway HTTP app: agents talk the APIs they already use; every call is recorded token for token.

``Gateway`` is a plain class: the GatewayShard actor hosts it, and ``python -m rayrl.gateway serve``
runs it standalone as a trace-capturing proxy. Three wire APIs (OpenAI Chat Completions, OpenAI
Responses, Anthropic Messages; modules openai_chat, openai_responses, anthropic_messages) translate to
one canonical request; turns.TurnRunner renders it to token ids, sends it to an engine as
``/generate`` with log-probs on, parses the answer and records a TurnRecord in the session's tree.

Logging: one line per non-2xx answer (method, path, status, session, reason; INFO for 4xx, WARNING for
5xx), written where the answer is made (the error middleware), before it is sent; a gateway bug is
logged once, with its traceback, instead. An error reported inside a stream that already answered 200
gets the same one line. Slow requests are logged too; never one line per request. (A request aiohttp
cannot even parse as HTTP never reaches the app: aiohttp answers and logs it.)

No request blocks the server: a body over ``OFF_LOOP_BYTES`` is decoded, validated, rendered and
tokenized in a worker thread (:meth:`Gateway.off_loop`), and the token limit (render.py) stops a huge
prompt early, so ``/health`` and other sessions' calls keep being answered meanwhile.

``/health`` is answered ahead of generation work: the listening socket belongs to a thread of its own
(front_door.FrontDoor), which answers health checks itself and hands every other connection, unread,
to the event loop. There the lean front (lean_front.py) reads it: LLM calls go to their handlers without
aiohttp's web layer, through the same error handling (:meth:`Gateway.answer`), and the first request of
any other kind hands the connection to aiohttp's server. The CPU work for LLM calls (decoding and
rendering a request, parsing and recording its answer) and for finishing sessions runs one piece at a
time under :attr:`Gateway.cpu`, a fair lock (work_lock.py); under contention each piece waits its turn
in a later turn of the event loop, after the sockets are polled again, so the calls of a thousand
sessions are taken in turn.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, TypeVar

from aiohttp import web

from rayrl.config import GatewayConfig, TrajectoryConfig
from rayrl.engines import http_input
from rayrl.engines.client import GenerateOutput
from rayrl.gateway import admin_stats, admin_trees, anthropic_messages, front_door, openai_chat, openai_responses
from rayrl.gateway.errors import RequestError

try:
    from rayrl.gateway import lean_front
    LEAN_FRONT = lean_front.fits_installed_aiohttp()
except ImportError:  # an aiohttp that moved an internal class the lean front builds on
    LEAN_FRONT = False
from rayrl.gateway.openapi import openapi_spec
from rayrl.gateway.params import TurnSpec, number
from rayrl.gateway.parsers import ThinkReasoningParser, get_tool_parser, infer_family
from rayrl.gateway.render import ChatRenderer
from rayrl.gateway.request_json import decode_object
from rayrl.gateway.sessions import Session, SessionInfo, SessionRegistry
from rayrl.gateway.turns import Prepared, TurnRunner
from rayrl.gateway.upstream import StreamingUpstream
from rayrl.gateway.work_lock import WorkLock
from rayrl.trajectory import TrajectoryTree
from rayrl.types import Sample

logger = logging.getLogger("rayrl.gateway")

_ANTHROPIC_PATHS = ("/v1/messages",)


def _request_key(name: str, kind: type) -> Any:
    """A key for per-request state: aiohttp >= 3.14 wants typed keys, older versions take the name."""
    make = getattr(web, "RequestKey", None)
    return make(name, kind) if make is not None else name


# per-request state (aiohttp requests are mappings): the caller's session, and whether its body is
# large enough to be handled off the event loop
_SESSION = _request_key("rayrl_session", Session)
_BIG = _request_key("rayrl_big", bool)
PREP_THREADS = 2  # worker threads for large requests (decode, render, tokenize)
SHUTDOWN_S = 60.0  # how long stop() lets calls in progress finish (aiohttp's AppRunner's shutdown_timeout)
T = TypeVar("T")


GC_YOUNG_THRESHOLD = 50_000  # allocations between young-generation collections while serving (CPython: 700)


def settle_heap() -> None:
    """Collect once, then take every object alive now out of the cyclic garbage collector's walks
    (``gc.freeze``), and collect less often. A gateway's process holds some 400K objects from its
    libraries (transformers and what it imports) by the time it serves; every full collection walked
    them all, for a large fraction of a second (docs/results/design_figures.md), with the event loop,
    ``/health`` included, stopped meanwhile. Once they are frozen, CPython's rule for a full collection
    (a quarter more long-lived objects than at the last one) fires far more often, since few objects
    count as long-lived; with young collections every ``GC_YOUNG_THRESHOLD`` allocations instead of
    every 700, full ones become rare again (each walks only what the gateway made since it started:
    sessions, connections). Objects made later are collected as usual, frozen ones still freed by
    reference counting. For a process that exists to host a gateway: the standalone server and the
    GatewayShard actor call it once the gateway serves."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def _printable(text: str) -> str:
    """Text safe for any log stream (a lone surrogate from a request would break a UTF-8 handler)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class Gateway:
    """OpenAI- and Anthropic-compatible gateway over an engine router, with per-session trajectory trees.

    ``router`` needs ``async generate(session_key, input_ids, sampling_params)`` returning an object with
    ``output_ids``, ``output_logprobs``, ``text``, ``finish_reason``, ``weight_version`` and ``versions``,
    plus ``generate_stream(session_key, input_ids, sampling_params, on_text)`` for streaming clients (see
    rayrl.engines.router.Router, which streams from the engines in both cases).
    ``on_text(text, output_ids=None, output_logprobs=None)`` takes the tokens so far when the router
    reports them (Chat Completions then streams log-probs with each content chunk).
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
        record: bool = True,
    ) -> None:
        """``record=False``: a frozen model's endpoint (rayrl/gateway/frozen.py): every LLM call, whatever its
        token, is answered in one built-in session that keeps no turn (``Session.record``)."""
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
        self.renderer = ChatRenderer(
            tokenizer, self.tool_parser, chat_template, inject_tool_schemas=cfg.inject_tool_schemas
        )
        self.reasoning_parser = (
            ThinkReasoningParser(self.renderer.generation_prompt_opens_think()) if reasoning_name == "think" else None
        )
        self.tokenizer = tokenizer
        self.sessions = SessionRegistry(trajectory_cfg, shard=shard)
        self.unrecorded: Session | None = None if record else Session(
            "frozen", "", {}, TrajectoryTree(session_id="frozen"), record=False)
        self.admin_token = admin_token or "rrl-admin-" + secrets.token_urlsafe(24)
        self.counters: dict[str, int] = {
            "requests": 0,
            "errors_4xx": 0,
            "errors_engine": 0,
            "errors_internal": 0,
            "tool_parse_errors": 0,
            "tool_choice_unmet": 0,
            "cumulative_hits": 0,
            "full_renders": 0,
            "generated_tokens": 0,
            "client_disconnects": 0,
            "stream_mismatches": 0,
        }
        self.upstream = StreamingUpstream(router, timeout_s=getattr(router, "timeout_s", 600.0))
        self.cpu = WorkLock()  # one piece of request work at a time (module docstring, work_lock.py)
        self.turns = TurnRunner(cfg, self.renderer, self.tool_parser, self.reasoning_parser, router,
                                self.upstream, context_length, self.counters, self.cpu)
        self.durations = {"record_turn": self.turns.record_times, "finish_session": self.sessions.finish_times}
        self.base_url = ""
        self._runner: web.AppRunner | None = None
        self.front: front_door.FrontDoor | None = None  # the listener; answers /health in its own thread
        self._adopting: set[asyncio.Task] = set()
        self._lean: set[lean_front.LeanFront] = set()  # connections served by the lean front (lean_front.py)
        self.max_body = int(cfg.max_body_mb * 1024 * 1024)
        self._prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="gateway-prep")
        self.llm_routes = {  # the LLM calls: through aiohttp's app, or the lean front for most connections
            "/v1/chat/completions": self._api(openai_chat.handle),
            "/v1/responses": self._api(openai_responses.handle),
            "/v1/messages": self._api(anthropic_messages.handle),
            "/v1/messages/count_tokens": self._api(anthropic_messages.count_tokens),
        }
        self.app = self._build_app()

    # -- lifecycle ---------------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._error_middleware])
        for path, handler in self.llm_routes.items():
            app.router.add_post(path, handler)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/", self._health)  # HEAD / too: Claude Code's connectivity check
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_get("/rayrl/stats", admin_stats.stats_handler(self))
        app.router.add_post("/rayrl/sessions", self._http_open_session)
        app.router.add_get("/rayrl/sessions/{session_id}", self._http_session_stats)
        app.router.add_post("/rayrl/sessions/{session_id}/finish", self._http_finish_session)
        app.router.add_get("/rayrl/sessions/{session_id}/tree", admin_trees.tree_handler(self))
        return app

    def _api(self, handler: Callable[[Any, web.Request], Awaitable[web.StreamResponse]]):
        """Bind an API module's handler to this gateway (handlers take the gateway explicitly)."""

        async def bound(request: web.Request) -> web.StreamResponse:
            self.counters["requests"] += 1
            return await handler(self, request)

        return bound

    async def start(self, host: str | None = None, port: int | None = None, advertise_host: str | None = None) -> str:
        """Serve on ``host:port`` (0 picks a free port); returns the base URL (…/v1). Bound to every
        interface (0.0.0.0, ::), the URL names ``advertise_host`` (the node's address) instead."""
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its
        # engine request (rayrl.engines.client / gateway.upstream) instead of generating for nobody.
        # auto_decompress off: http_input.read_body decodes Content-Encoding itself, so a body that does
        # not decode is a JSON 4xx in the route's dialect, and a compressed body's decoded size is bounded
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     auto_decompress=False)
        await self._runner.setup()
        sock = front_door.bind(host or self.cfg.host, self.cfg.port if port is None else port)
        self.front = front_door.FrontDoor(sock, asyncio.get_running_loop(), self._adopt, self.health_status)
        self.front.start()
        bound_host, bound_port = sock.getsockname()[:2]
        if bound_host in ("0.0.0.0", "::") and advertise_host:
            bound_host = advertise_host
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.base_url = f"http://{shown}:{bound_port}/v1"
        return self.base_url

    def _adopt(self, sock: socket.socket) -> None:
        """A connection the front door hands over: served from its first byte by the lean front, which
        answers the LLM calls and hands anything else to aiohttp's server (lean_front.py)."""
        runner = self._runner
        if runner is None or runner.server is None:
            sock.close()
            return
        server, max_body = runner.server, self.max_body

        def protocol() -> asyncio.Protocol:
            if not LEAN_FRONT:  # an aiohttp the lean front was not checked on: its server serves everything
                return server()
            return lean_front.LeanFront(self.llm_routes, self.answer, server, max_body, self._lean)

        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(protocol, sock))
        self._adopting.add(task)
        task.add_done_callback(lambda done: self._adopted(done, sock))

    def _adopted(self, task: asyncio.Task, sock: socket.socket) -> None:
        self._adopting.discard(task)
        if task.cancelled() or task.exception() is not None:
            sock.close()
            if not task.cancelled():
                logger.warning("gateway: a connection could not be served: %s", task.exception())

    async def stop(self) -> None:
        if self.front is not None:
            self.front.stop()
            self.front = None
        if self._lean:
            await asyncio.gather(*(c.shutdown(SHUTDOWN_S) for c in list(self._lean)))
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.upstream.close()
        self._prep.shutdown(wait=False, cancel_futures=True)

    # -- sessions (in-process API used by the GatewayShard actor) -----------------------------

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
        return await self.cpu.run(lambda: self.sessions.finish(session_id, reward, metadata))

    def session_stats(self, session_id: str) -> dict[str, Any]:
        return self.sessions.stats_of(session_id)

    # -- HTTP plumbing -----------------------------------------------------------------------------

    @web.middleware
    async def _error_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        return await self.answer(request, handler)

    async def answer(self, request: web.BaseRequest, handler: Callable[[Any], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        """``handler(request)``, every failure a JSON error in the route's dialect, logged in one line (the
        app's middleware, and the lean front's way to a handler)."""
        started = time.monotonic()
        anthropic = request.path.startswith(_ANTHROPIC_PATHS)
        try:
            response = await handler(request)
        except RequestError as err:
            return self._error_response(request, err, anthropic)
        except web.HTTPException as err:
            if err.status < 400:
                raise
            message = err.reason or "request error"
            if err.status == 413:
                message = f"request body larger than {self.cfg.max_body_mb} MB"
            elif err.status == 404:
                message = f"no route {request.method} {request.path}"
            return self._error_response(request, RequestError(message, status=err.status), anthropic)
        except ConnectionResetError:
            # The client went away while we were streaming to it; the engine request was aborted.
            self.counters["client_disconnects"] += 1
            self._log_failure(request, 499, "the client disconnected")
            return web.Response(status=499)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a gateway bug: answer, count, log once with the traceback
            self.counters["errors_internal"] += 1
            session = request.get(_SESSION)
            logger.exception("%s %s -> 500 session=%s: internal error", request.method, request.path,
                             session.session_id if session is not None else "-")
            return self._error_response(request, RequestError(f"internal error: {type(err).__name__}", 500),
                                        anthropic, logged=True)
        elapsed = time.monotonic() - started
        if elapsed > self.cfg.slow_request_log_s:
            logger.warning("slow request %s %s: %.1f s", request.method, request.path, elapsed)
        return response

    def _count_failure(self, request: web.Request, err: RequestError) -> None:
        """Count one failed answer: a 4xx, or for a 5xx the caller's session's infrastructure errors."""
        if 400 <= err.status < 500:
            self.counters["errors_4xx"] += 1
        elif err.status >= 500:
            session = request.get(_SESSION)
            if session is not None:
                session.note_infra_error(err.message)

    def _log_failure(self, request: web.Request, status: int, reason: str, where: str = "") -> None:
        """The one line per failed answer: method, path, status, session, reason."""
        session = request.get(_SESSION)
        logger.log(logging.WARNING if status >= 500 else logging.INFO, "%s %s -> %d%s session=%s: %s",
                   request.method, request.path, status, where, session.session_id if session is not None else "-",
                   _printable(reason))

    def _error_response(self, request: web.Request, err: RequestError, anthropic: bool,
                        logged: bool = False) -> web.Response:
        self._count_failure(request, err)
        if not logged:
            self._log_failure(request, err.status, err.message)
        body = err.anthropic_body() if anthropic else err.openai_body()
        return web.json_response(body, status=err.status)

    def stream_failed(self, request: web.Request, err: RequestError) -> None:
        """An error reported inside a stream that already answered 200: counted and logged once, as a
        non-2xx answer is (streaming handlers call this, then send the error in their dialect)."""
        self._count_failure(request, err)
        self._log_failure(request, err.status, err.message, " in-stream")

    async def off_loop(self, request: web.Request, work: Callable[[], T]) -> T:
        """``work()``, in a worker thread when the request's body is large (it may render and tokenize
        for a long time), inline otherwise (a thread hop costs more than a small request's work), as one
        piece of work under :attr:`cpu`."""
        if request.get(_BIG):
            return await asyncio.get_running_loop().run_in_executor(self._prep, work)
        return await self.cpu.run(work)

    async def json_body(self, request: web.Request) -> dict[str, Any]:
        """The request body as a JSON object; any decoding failure is a 4xx naming what was wrong
        (Content-Encoding, charset, JSON, a lone surrogate's field; 413 when too large)."""
        raw, charset = await self._raw_body(request)
        return await self.off_loop(request, lambda: self._decode(raw, charset))

    async def _raw_body(self, request: web.Request) -> tuple[bytes, str | None]:
        """The body's bytes (decompressed) and declared charset; marks a large body for :meth:`off_loop`."""
        try:
            raw = await http_input.read_body(request)
        except http_input.RequestError as err:
            raise RequestError(str(err), status=err.status) from None
        request[_BIG] = len(raw) > http_input.OFF_LOOP_BYTES
        return raw, http_input.request_charset(request)

    @staticmethod
    def _decode(raw: bytes, charset: str | None) -> dict[str, Any]:
        return decode_object(raw, charset)

    async def turn_request(
        self, request: web.Request, session: Session, parse: Callable[[dict[str, Any]], TurnSpec]
    ) -> tuple[dict[str, Any], TurnSpec, Prepared]:
        """An LLM call's body decoded (as :meth:`json_body`), parsed into a TurnSpec by ``parse`` and its
        prompt rendered: one piece of work under :attr:`cpu` (in a worker thread when the body is large),
        then the call counted and admitted on the event loop."""
        raw, charset = await self._raw_body(request)

        def work() -> tuple[dict[str, Any], TurnSpec, Prepared]:
            body = self._decode(raw, charset)
            spec = parse(body)
            return body, spec, self.turns.build(session, spec)

        body, spec, prepared = await self.off_loop(request, work)
        self.turns.count(session, prepared)
        return body, spec, prepared

    @staticmethod
    def _bearer(request: web.Request) -> str | None:
        """The caller's token: ``Authorization: Bearer`` (OpenAI, Claude Code's AUTH_TOKEN) or
        ``x-api-key`` (Anthropic SDK, Claude Code's API_KEY)."""
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer ") and auth[7:].strip():
            return auth[7:].strip()
        return request.headers.get("x-api-key")

    def session_for(self, request: web.Request) -> Session:
        """The open session this request's token belongs to (401 unknown, 409 finished); the built-in one of a
        gateway that records nothing."""
        session = self.unrecorded or self.sessions.by_token(self._bearer(request))
        if session.finished:
            raise RequestError("this session has finished; open a new one", status=409)
        session.api_calls += 1
        request[_SESSION] = session
        return session

    def logprob_content(self, out: GenerateOutput) -> list[dict[str, Any]]:
        """OpenAI ``logprobs.content`` entries for a completion."""
        return self.logprob_entries(out.output_ids.tolist(), out.output_logprobs.tolist())

    def logprob_entries(self, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        """OpenAI ``logprobs.content`` entries for some output tokens."""
        items = []
        for tid, lp in zip(ids, logprobs):
            token = self.tokenizer.convert_ids_to_tokens(tid)
            items.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
        return items

    def _check_admin(self, request: web.Request) -> None:
        if not secrets.compare_digest((self._bearer(request) or "").encode(), self.admin_token.encode()):
            raise RequestError("admin token required", status=401)

    def health_status(self) -> dict[str, Any]:
        """The body of a healthy ``/health`` answer (read by the front door's thread: reads only)."""
        return {"status": "ok", "open_sessions": self.sessions.open_sessions}

    async def _health(self, request: web.Request) -> web.Response:
        """``/health`` on a connection the front door already handed over (it answers the rest itself):
        the same answer."""
        code, body = self.front.verdict() if self.front is not None else (200, self.health_status())
        return web.json_response(body, status=code)

    async def _models(self, request: web.Request) -> web.Response:
        names = [self.model_name] + [n for n in self.cfg.served_model_names if n != self.model_name]
        return web.json_response(
            {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "rayrl"} for n in names]}
        )

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_spec())

    async def _http_session_stats(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        sid = request.match_info["session_id"]
        return web.json_response({"session_id": sid, "stats": self.sessions.stats_of(sid)})

    async def _http_open_session(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        body = await self.json_body(request) if request.can_read_body else {}
        metadata = body.get("metadata", {})
        if not isinstance(metadata, dict):
            raise RequestError("metadata must be an object", param="metadata")
        info = self.open_session(metadata)
        return web.json_response({"session_id": info.session_id, "token": info.token, "base_url": info.base_url})

    async def _http_finish_session(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        body = await self.json_body(request)
        reward = number(body, "reward", -1e30, 1e30, 0.0)
        sid = request.match_info["session_id"]
        stats = self.sessions.stats_of(sid)
        samples = await self.finish_session(sid, reward)
        body = await self.cpu.run(
            lambda: json.dumps({"session_id": sid, "stats": stats, "samples": [s.to_dict() for s in samples]}))
        return web.Response(text=body, content_type="application/json")
