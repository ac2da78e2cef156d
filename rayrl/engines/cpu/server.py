"""SGLang's native HTTP API served over a :class:`CPUEngine` (aiohttp).

The point is byte-level compatibility: EngineClient, the router and every RL caller talk to this server
exactly as they talk to SGLang on GPU (see /work/shared/reference/sglang_api.md for the contract), so
the CPU tests exercise the GPU path's client code.

Errors: bad input is answered 400 with SGLang's body ``{"object":"error","message":...,"type":"Bad
Request","param":null,"code":400}``, never a 5xx: values out of the range the engine can hold included
(sampling.SamplingParams), so one caller's request can never fail the batch it would join. A request
the engine fails while it runs (engine.py: it fails alone) is still answered 200, as SGLang does, with
``finish_reason`` ``{"type": "abort", "message", "status_code", "err_type"}``: in a batch, the other
items are unaffected. Weight/handler failures use the endpoint's own ``{"success": false, "message":
...}`` shape, as SGLang does. Only non-2xx and slow requests are logged. A client that disconnects from
``/generate`` aborts its requests. Large bodies are parsed off the event loop (http_input.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

from aiohttp import web

from rayrl import __version__
from rayrl.engines.cpu.engine import PAUSE_MODES, CPUEngine, GenerationResult, RequestHandle
from rayrl.engines.cpu.generate_request import GenerateBatch, GenerateItem, parse_generate
from rayrl.engines.cpu.memory_occupation import EngineBusy
from rayrl.engines.cpu.weight_routes import WeightEndpoints
from rayrl.engines.http_input import (
    OFF_LOOP_BYTES,
    RequestError,
    bool_flag,
    error_response,
    json_object,
    read_body,
    read_json,
    request_charset,
)
from rayrl.weights.group import WeightGroups
from rayrl.weights.owners import WEIGHT_BUFFERS

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
CONTROL_LOG_LENGTH = 256
CONTROL_PATHS = frozenset({
    "/update_weight_version", "/update_weights_from_disk", "/update_weights_from_tensor",
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
    "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache", "/pause_generation",
    "/continue_generation", "/set_weight_format", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
})


class EngineServer(WeightEndpoints):
    """The aiohttp application; ``start()`` binds it (loopback by default) and returns the base URL."""

    def __init__(
        self,
        engine: CPUEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        server_args: Optional[dict[str, Any]] = None,
        slow_request_s: float = 120.0,
        max_body_mb: float = 4096.0,
        tp_size: int = 1,
        tp_gpus: Sequence[str] = (),
    ) -> None:
        self.engine = engine
        self.tp_size = tp_size  # tensor-parallel ranks this engine stands for (rayrl/engines/cpu/weight_routes.py)
        self.tp_gpus = tuple(str(g) for g in tp_gpus)[:tp_size]
        self.tp_payload_gpus: list[Optional[str]] = []  # the GPU each entry of the last tensor update came from
        self.host = host
        self.port = port
        self.server_args = dict(server_args or {})
        self.slow_request_s = slow_request_s
        self.app = web.Application(
            client_max_size=int(max_body_mb * 1024 * 1024), middlewares=[self._middleware]
        )
        self._routes()
        self._runner: Optional[web.AppRunner] = None
        self.url = ""
        self.weight_groups = WeightGroups()  # /init_weights_update_group: trainer -> engine groups
        self.weight_group_timeout_s = 300.0  # rendezvous and per-call broadcast limit
        # the state-changing calls that succeeded, in order (/get_server_info "control_calls"): who paused,
        # released, loaded weights when, as this engine saw it
        self.control_calls: deque[str] = deque(maxlen=CONTROL_LOG_LENGTH)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its requests.
        # auto_decompress off: http_input.read_body decodes Content-Encoding (bounded, JSON 4xx errors).
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
        self.port = sockets[0].getsockname()[1] if sockets else self.port
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        self.weight_groups.destroy_all()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _routes(self) -> None:
        r = self.app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/get_load", self.get_load)
        for path in ("/get_weight_version", "/weight_version"):  # gone from SGLang 0.5.8 on; served here
            r.add_get(path, self.get_weight_version)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/set_weight_format", self.set_weight_format)
        r.add_post("/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        r.add_get("/v1/models", self.models)
        for path, handler in (
            ("/release_memory_occupation", self.release_memory),
            ("/resume_memory_occupation", self.resume_memory),
            ("/flush_cache", self.flush_cache),
        ):
            r.add_get(path, handler)
            r.add_post(path, handler)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        start = time.perf_counter()
        try:
            response = await handler(request)
        except RequestError as err:
            response = error_response(err.status, str(err))
        except ValueError as err:  # engine-side validation (SamplingParams, prompts, tags)
            response = error_response(400, str(err))
        except web.HTTPRequestEntityTooLarge as err:
            response = error_response(413, err.text or "request body too large")
        except web.HTTPException as err:
            if err.status < 400:
                raise
            response = error_response(err.status, err.reason)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as err:
            logger.exception("%s %s failed", request.method, request.path)
            response = error_response(500, f"internal error: {type(err).__name__}: {err}")
        elapsed = time.perf_counter() - start
        if response.status < 300 and request.path in CONTROL_PATHS:
            self.control_calls.append(request.path.lstrip("/"))
        if response.status >= 300 or elapsed > self.slow_request_s:
            message = ""
            if isinstance(response, web.Response) and response.status >= 300 and response.body is not None:
                message = bytes(response.body)[:300].decode("utf-8", "replace")
            logger.warning(
                "%s %s -> %d in %.2fs %s", request.method, request.path, response.status, elapsed, message
            )
        return response

    # ------------------------------------------------------------------ generate

    def _submit_all(self, batch: GenerateBatch, wake: Callable[[RequestHandle], None]) -> list[RequestHandle]:
        handles: list[RequestHandle] = []
        try:
            for item in batch.items:
                handles.append(
                    self.engine.submit(
                        item.input_ids,
                        item.params,
                        item.rid,
                        return_logprob=item.return_logprob,
                        logprob_start_len=item.logprob_start_len,
                        stream=batch.stream,
                        on_update=wake,
                    )
                )
        except Exception:
            for h in handles:
                self.engine.abort(h.rid)
            raise
        return handles

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await read_body(request)
        loop = asyncio.get_running_loop()

        def parse() -> GenerateBatch:
            return parse_generate(json_object(raw, request_charset(request)), self.engine)

        # a large body (long prompts, text to tokenize) is parsed off the event loop: /health and the
        # other requests' streams keep going meanwhile
        batch = await loop.run_in_executor(None, parse) if len(raw) > OFF_LOOP_BYTES else parse()
        changed = asyncio.Event()

        def wake(_: RequestHandle) -> None:
            loop.call_soon_threadsafe(changed.set)

        handles = self._submit_all(batch, wake)
        try:
            if batch.stream:
                return await self._stream(request, batch, handles, changed)
            while not all(h.finished for h in handles):
                await changed.wait()
                changed.clear()
            results = [
                self._result_json(h.result(), item, batch.text_in_logprobs)
                for h, item in zip(handles, batch.items)
            ]
            return web.json_response(results[0] if batch.single else results)
        finally:
            for h in handles:  # client gone (handler cancelled) or stream broken: stop generating
                if not h.finished:
                    self.engine.abort(h.rid)

    async def _stream(
        self, request: web.Request, batch: GenerateBatch, handles: list[RequestHandle], changed: asyncio.Event
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        sent = [0] * len(handles)
        done = [False] * len(handles)
        while not all(done):
            await changed.wait()
            changed.clear()
            for i, (h, item) in enumerate(zip(handles, batch.items)):
                if done[i]:
                    continue
                if h.finished:
                    chunk = self._result_json(h.result(), item, batch.text_in_logprobs)
                    done[i] = True
                elif len(h.output_ids) > sent[i]:
                    chunk = self._partial_json(h, item, batch.text_in_logprobs)
                else:
                    continue
                sent[i] = len(chunk["output_ids"])
                if not batch.single:
                    chunk["index"] = i
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _logprob_entries(
        self, ids: list[int], lps: list[Optional[float]], with_text: bool
    ) -> list[list[Any]]:
        tok = self.engine.tokenizer
        if with_text:
            return [[lp, i, tok.decode([i])] for lp, i in zip(lps, ids)]
        return [[lp, i, None] for lp, i in zip(lps, ids)]

    def _result_json(self, res: GenerationResult, item: GenerateItem, text_in_lps: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": res.rid,
            "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": len(res.output_ids),
            "cached_tokens": res.cached_tokens,
            "weight_version": res.weight_version,
            "e2e_latency": res.e2e_latency,
        }
        if item.return_logprob:
            meta["output_token_logprobs"] = self._logprob_entries(
                res.output_ids, res.output_logprobs, text_in_lps
            )
            inputs = res.input_token_logprobs or []
            first = item.logprob_start_len
            meta["input_token_logprobs"] = (
                self._logprob_entries(item.input_ids[first:], inputs, text_in_lps) if first >= 0 else []
            )
        if res.token_versions is not None:
            meta["output_token_versions"] = res.token_versions
        return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}

    def _partial_json(self, h: RequestHandle, item: GenerateItem, text_in_lps: bool) -> dict[str, Any]:
        ids = list(h.output_ids)
        lps = list(h.output_logprobs)
        n = min(len(ids), len(lps))
        ids, lps = ids[:n], lps[:n]
        meta: dict[str, Any] = {
            "id": h.rid,
            "finish_reason": None,
            "prompt_tokens": len(h.prompt_ids),
            "completion_tokens": n,
            "cached_tokens": h.cached_tokens,
            "weight_version": self.engine.weight_version,
        }
        if item.return_logprob:
            meta["output_token_logprobs"] = self._logprob_entries(ids, lps, text_in_lps)
        text = self.engine.tokenizer.decode(ids, skip_special_tokens=item.params.skip_special_tokens)
        return {"text": text, "output_ids": ids, "meta_info": meta}

    # ------------------------------------------------------------------ status

    async def health(self, request: web.Request) -> web.Response:
        """/health: 200 while the decode loop runs. /health_generate also runs a 1-token generation
        (skipped while paused, when generation is intentionally stopped)."""
        if not self.engine.alive():
            return web.Response(status=503)
        if request.path == "/health_generate" and not self.engine.paused:
            loop = asyncio.get_running_loop()
            finished = asyncio.Event()
            try:
                handle = self.engine.submit(
                    [0],
                    {"max_new_tokens": 1, "temperature": 0.0},
                    f"HEALTH_CHECK_{time.time_ns()}",
                    on_update=lambda _: loop.call_soon_threadsafe(finished.set),
                )
            except RuntimeError:  # shutting down
                return web.Response(status=503)
            try:
                await asyncio.wait_for(finished.wait(), HEALTH_TIMEOUT_S)
            except asyncio.TimeoutError:
                self.engine.abort(handle.rid)
                return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.engine.model.config
        return web.json_response(
            {
                "model_path": self.server_args.get("model_path", self.engine.model_path),
                "tokenizer_path": self.server_args.get("tokenizer_path", self.engine.model_path),
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None),
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        """``/v1/models`` as SGLang lists them: the base model, then each LoRA adapter (``parent``: the base)."""
        name = self.server_args.get("served_model_name", self.engine.model_path)
        cards = [{"id": name, "object": "model", "owned_by": "sglang", "root": name, "parent": None,
                  "max_model_len": self.engine.context_length}]
        adapter = self.engine.adapter
        if adapter is not None:
            cards.append({"id": adapter.name, "object": "model", "owned_by": "sglang", "root": "__tensor__",
                          "parent": name, "max_model_len": None})
        return web.json_response({"object": "list", "data": cards})

    async def server_info(self, request: web.Request) -> web.Response:
        stats = self.engine.stats()
        info = {
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.model_path,
            "host": self.host,
            "port": self.port,
            "dtype": self.engine.dtype,
            "context_length": self.engine.context_length,
            "max_running_requests": self.engine.max_batch_size,
            "max_total_num_tokens": self.engine.max_batch_size * self.engine.context_length,
            "max_req_input_len": self.engine.context_length - 1,
            "tp_size": self.tp_size,
            "dp_size": 1,
            "skip_tokenizer_init": False,
            "enable_memory_saver": False,
            "weight_version": self.engine.weight_version,
            "backend": "rayrl-cpu",
            "weight_buffers": WEIGHT_BUFFERS,  # it opens rayrl SharedBuffers by name (rayrl/weights/shm.py)
            **self.server_args,
            "internal_states": [stats],
            "control_calls": list(self.control_calls),
            "tp_gpus": list(self.tp_gpus),
            "tp_payload_gpus": list(self.tp_payload_gpus),  # the last tensor update's entries, by TP rank
            "version": f"rayrl-cpu-{__version__}",
        }
        return web.json_response(info)

    async def get_load(self, request: web.Request) -> web.Response:
        s = self.engine.stats()
        return web.json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": s["running"] + s["waiting"],
                    "num_waiting_reqs": s["waiting"],
                    "num_tokens": 0,
                }
            ]
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    # ------------------------------------------------------------------ control

    async def release_memory(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        # releasing the KV cache empties the prefix cache on the engine thread: wait off the event loop
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.release_memory_occupation,
                                                             body.get("tags"))
        except EngineBusy as err:
            raise RequestError(str(err)) from None
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        self.engine.resume_memory_occupation(body.get("tags"))
        return web.json_response(None)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        mode = body.get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}")
        await asyncio.get_running_loop().run_in_executor(None, self.engine.pause, mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_json(request, allow_empty=True)
        self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        rid = body.get("rid", "") or ""
        if not isinstance(rid, str):
            raise RequestError("rid must be a string")
        if bool_flag(body, "abort_all"):
            self.engine.abort_all()
        elif rid:
            self.engine.abort(rid)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        flushed = await asyncio.get_running_loop().run_in_executor(None, self.engine.flush_cache)
        return web.Response(  # SGLang 0.5.9's answer: 400 while requests are running or waiting
            status=200 if flushed else 400,
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )
