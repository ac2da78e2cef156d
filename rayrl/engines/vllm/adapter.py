"""The vllm backend's server: rayrl's engine API (rayrl/engines/api.py ``ROUTES``) over a real vLLM.

``python -m rayrl.engines.vllm.adapter --vllm-python PY ...`` (rayrl's interpreter) starts vLLM's own
OpenAI server from vLLM's interpreter (``engine.vllm.python``: vLLM pins transformers 5, rayrl's SGLang
pin needs 4, so they live in separate venvs) as its child, on a loopback port of its own, and serves
rayrl's routes by calling vLLM's own:

==============================  ===================================================================
rayrl route                     vLLM 0.32 route (``VLLM_SERVER_DEV_MODE=1`` for the RL ones)
==============================  ===================================================================
``/generate`` (``input_ids``)   ``/inference/v1/generate``: token ids in, token ids, raw log-probs,
                                text and weight-version spans out (stream or not)
``/abort_request``              ``/abort_requests`` (vLLM's id is ``generate-tokens-<rid>``)
``/pause_generation``           ``/pause?mode=abort|keep`` (SGLang's ``in_place`` and ``retract``
                                both become ``keep``: vLLM has no retract)
``/continue_generation``        ``/resume``
``/flush_cache``                ``/reset_prefix_cache``
``/update_weights_from_tensor`` ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``
``/update_weights_from_disk``   the same, with the ``rayrl_shm`` engine (rayrl/engines/vllm/worker.py)
``/update_weight_version``      ``/update_weight_version``; ``/model_info``: ``/weight_info``
``/release_memory_occupation``  ``/sleep`` where vLLM runs with sleep mode (GPU); on CPU, where vLLM
                                refuses sleep mode, the prefix cache is reset and nothing is freed
==============================  ===================================================================

Why a server in front and not a second client: the router streams ``/generate`` with its own lean
HTTP client and folds SGLang's chunks (rayrl/engines/stream_fold.py), the weight senders, the fleet's
control calls and the distillation teacher all speak ``EngineAPI`` over SGLang's routes, and the
schedules read the engine's ``control_calls``; one translation here leaves every one of them as it is
(docs/architecture.md). The price is one loopback hop per call (bench/engine_vs_vllm.py measures the
whole).

A vLLM that lacks one of the routes above (too old, or started without dev mode) stops the start with
one line naming the missing routes; so does a vLLM that exits or does not answer in time.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import aiohttp
from aiohttp import web

from rayrl.engines import wire_json
from rayrl.engines.api import check_memory_tags
from rayrl.engines.http_input import RequestError, bool_flag, error_response, read_json
from rayrl.engines.vllm.process import (
    REQUIRED_ROUTES,
    VLLMOutput,
    die_with_parent,
    tokenizer_override,
    vllm_command,
    vllm_env,
)
from rayrl.engines.vllm.requests import (
    GenerateTranslation,
    StreamState,
    check_tp_entries_count,
    error_message,
    translate_generate,
)
from rayrl.ports import free_port
from rayrl.weights.owners import WEIGHT_BUFFERS, sweep_quietly

logger = logging.getLogger("rayrl.engines.vllm.adapter")

CONTROL_PATHS = frozenset({
    "/update_weight_version", "/update_weights_from_disk", "/update_weights_from_tensor",
    "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache", "/pause_generation",
    "/continue_generation",
})  # fmt: skip
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}
SESSION_WAIT_S = 600.0  # how long a generation waits for an open weight-update session to finish


class VLLMAdapter:
    """The aiohttp app serving rayrl's routes over the vLLM at ``upstream`` (see the module docstring)."""

    def __init__(self, upstream: str, model_path: str, tp_size: int, device: str, info: dict[str, Any]) -> None:
        self.upstream = upstream.rstrip("/")
        self.model_path = model_path
        self.tp_size = tp_size
        self.device = device
        self.info = dict(info)
        self.ready = False
        self.failed: Optional[str] = None
        self.control_calls: list[str] = []
        self.released: set[str] = set()
        self._weights_lock = asyncio.Lock()
        self._session_open = False  # a version's buckets are one vLLM weight-update session
        self._weights_ready: Optional[asyncio.Event] = None  # cleared while a session is open
        self._session: Optional[aiohttp.ClientSession] = None
        self.app = web.Application(middlewares=[self._middleware], client_max_size=1 << 30)
        r = self.app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_route("*", "/release_memory_occupation", self.release_memory)
        r.add_route("*", "/resume_memory_occupation", self.resume_memory)
        for path in ("/init_weights_update_group", "/update_weights_from_distributed",
                     "/destroy_weights_update_group"):
            r.add_post(path, self.no_broadcast)

    # -- plumbing ------------------------------------------------------------------------------------

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                                  connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(self, method: str, path: str, *, json: Any = None, params: Any = None,
                   timeout_s: float = 600.0) -> Any:
        """One call to vLLM; a non-2xx answer raises RequestError with vLLM's status and message."""
        async with self.session().request(method, self.upstream + path, json=json, params=params,
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            if resp.status >= 300:
                raise RequestError(f"vLLM {path}: {error_message(raw)}", status=resp.status)
            try:
                return wire_json.loads(raw) if raw else None
            except ValueError:
                return raw.decode("utf-8", "replace")

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not self.ready and request.path != "/health":
            return error_response(503, self.failed or "vLLM is starting")
        try:
            response = await handler(request)
        except RequestError as err:
            response = error_response(err.status, str(err))
        except aiohttp.ClientError as err:
            response = error_response(503, f"vLLM is unreachable: {type(err).__name__}: {err}")
        except web.HTTPException as err:
            if err.status < 400:
                raise
            response = error_response(err.status, err.reason)
        if response.status < 300 and request.path in CONTROL_PATHS:
            self.control_calls.append(request.path.lstrip("/"))
            del self.control_calls[:-256]
        if response.status >= 300 and self.ready:
            logger.warning("%s %s -> %d", request.method, request.path, response.status)
        return response

    # -- generation ----------------------------------------------------------------------------------

    def _ready_event(self) -> asyncio.Event:
        if self._weights_ready is None:
            self._weights_ready = asyncio.Event()
            self._weights_ready.set()
        return self._weights_ready

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        plan = translate_generate(body)
        if self._session_open:  # vLLM's layers are in checkpoint form until the session's last bucket
            try:
                await asyncio.wait_for(self._ready_event().wait(), SESSION_WAIT_S)
            except asyncio.TimeoutError:
                raise RequestError("a weight update has been in progress for longer than "
                                   f"{SESSION_WAIT_S:.0f} s", status=503) from None
        if not plan.stream:
            return web.json_response(await self._generate_whole(plan))
        return await self._generate_stream(request, plan)

    async def _generate_whole(self, plan: GenerateTranslation) -> dict[str, Any]:
        answer = await self.call("POST", "/inference/v1/generate", json=plan.request, timeout_s=24 * 3600)
        return plan.whole_answer(answer)

    async def _generate_stream(self, request: web.Request, plan: GenerateTranslation) -> web.StreamResponse:
        state = StreamState(plan)
        async with self.session().post(self.upstream + "/inference/v1/generate", json=plan.request) as upstream:
            if upstream.status >= 300:
                raise RequestError(f"vLLM /inference/v1/generate: {error_message(await upstream.read())}",
                                   status=upstream.status)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            async for line in upstream.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = state.fold(wire_json.loads(data))
                if chunk is not None:
                    await response.write(b"data: " + wire_json.dumps(chunk) + b"\n\n")
            if not state.finished:  # vLLM's stream ended without a finish reason: say so, as SGLang would
                await response.write(b"data: " + wire_json.dumps(state.aborted("vLLM's stream ended early")) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        if bool_flag(body, "abort_all"):
            await self.call("POST", "/abort_requests", json={})
        else:
            rid = body.get("rid")
            if not isinstance(rid, str) or not rid:
                raise RequestError("abort_request needs rid (a string) or abort_all: true")
            await self.call("POST", "/abort_requests", json={"request_ids": [f"generate-tokens-{rid}"]})
        return web.json_response({"success": True})

    # -- control -------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready:
            return error_response(503, self.failed or "vLLM is starting")
        await self.call("GET", "/health", timeout_s=20.0)
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        version = (await self.call("GET", "/weight_info", timeout_s=30.0))["weight_version"]
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "is_generation": True, "weight_version": version})

    async def server_info(self, request: web.Request) -> web.Response:
        version = (await self.call("GET", "/weight_info", timeout_s=30.0))["weight_version"]
        info = {**self.info, "model_path": self.model_path, "tp_size": self.tp_size, "weight_version": version,
                "backend": "vllm", "vllm_url": self.upstream, "control_calls": list(self.control_calls),
                "released_memory": sorted(self.released)}
        if self.device == "cpu":
            info["weight_buffers"] = WEIGHT_BUFFERS  # the rayrl_shm engine opens rayrl's buffers by name
        return web.json_response(info)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        mode = body.get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await self.call("POST", "/pause", params={"mode": PAUSE_MODES[mode], "clear_cache": "false"})
        return web.json_response({"success": True, "mode": mode, "vllm_mode": PAUSE_MODES[mode]})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.call("POST", "/resume")
        return web.json_response({"success": True})

    async def flush_cache(self, request: web.Request) -> web.Response:
        answer = await self.call("POST", "/reset_prefix_cache")
        if isinstance(answer, dict) and answer.get("success") is False:
            raise RequestError("vLLM did not reset its prefix cache (requests are running)", status=409)
        return web.Response(text="Cache flushed.")

    async def release_memory(self, request: web.Request) -> web.Response:
        tags = check_memory_tags((await read_json(request, allow_empty=True)).get("tags"), RequestError)
        if self.device == "cuda":
            await self.call("POST", "/sleep", params={"level": "1", "mode": "abort"})
        elif "kv_cache" in tags:
            await self.call("POST", "/reset_prefix_cache")  # as SGLang's release empties its radix cache
        self.released.update(tags)
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = check_memory_tags((await read_json(request, allow_empty=True)).get("tags"), RequestError)
        if self.device == "cuda":
            await self.call("POST", "/wake_up", params=[("tags", t) for t in tags if t != "cuda_graph"])
        self.released.difference_update(tags)
        return web.json_response(None)

    async def no_broadcast(self, request: web.Request) -> web.Response:
        raise RequestError(
            f"{request.path}: the vllm backend takes weights over pipeline.weight_transfer tensor or disk; vLLM's "
            "broadcast engine is its own NCCL group (GPU), which rayrl's broadcast sender does not join"
        )

    # -- weights -------------------------------------------------------------------------------------

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        version = body.get("new_version")
        if not isinstance(version, (str, int)) or isinstance(version, bool) or str(version) == "":
            raise RequestError("new_version must be a non-empty string")
        await self.call("POST", "/update_weight_version", json={"new_version": str(version)})
        return web.json_response({"success": True, "new_version": str(version)})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries or not all(isinstance(e, str) for e in entries):
            raise RequestError("serialized_named_tensors must be a non-empty list of base64 strings")
        if body.get("load_format") not in (None, "direct", "flattened_bucket"):
            raise RequestError(f"load_format {body.get('load_format')!r} is not supported by the vllm backend "
                               '(null, "direct" or "flattened_bucket": rayrl shared-memory handles)')
        check_tp_entries_count(entries, self.tp_size)
        if self.device == "cpu":  # CUDA handles are opened by vLLM's workers only, never in this process
            await asyncio.get_running_loop().run_in_executor(None, _check_payloads, entries)
        infos = [{"payload": e} for e in entries]
        # SGLang's senders mark a version's last bucket with flush_cache and the version (handles.py)
        last = bool_flag(body, "flush_cache", default=True) or body.get("weight_version") is not None
        return await self._update(body, infos[0] if len(infos) == 1 else infos, last)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise RequestError("model_path must be a non-empty string")
        if not any(Path(path).glob("*.safetensors")):
            raise RequestError(f"model_path {path}: no *.safetensors files there")
        return await self._update(body, {"safetensors_dir": path}, last=True)

    async def _update(self, body: dict[str, Any], update_info: Any, last: bool) -> web.Response:
        """One bucket into vLLM's own weight-update session: the first bucket of a version opens it
        (``/start_weight_update``), the last one (``last``) closes it with the version and resets the
        prefix cache. Generations wait while it is open (rayrl/engines/vllm/worker.py says why)."""
        version = body.get("weight_version")
        if version is not None and (not isinstance(version, (str, int)) or isinstance(version, bool)):
            raise RequestError("weight_version must be a string")
        async with self._weights_lock:
            if bool_flag(body, "abort_all_requests"):
                await self.call("POST", "/abort_requests", json={})
            if not self._session_open:
                await self.call("POST", "/start_weight_update")
                self._session_open = True
                self._ready_event().clear()
            try:
                await self.call("POST", "/update_weights", json={"update_info": update_info})
            except RequestError as err:
                await self._close_failed_session()
                return web.json_response({"success": False, "message": f"Failed to update weights: {err}"},
                                         status=400 if err.status < 500 else err.status)
            if last:
                await self.call("POST", "/finish_weight_update",
                                json={"weight_version": None if version is None else str(version)})
                self._session_open = False
                self._ready_event().set()
                # no KV of the old weights may be reused
                await self.call("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def _close_failed_session(self) -> None:
        """After a failed bucket the worker has ended the session but its layers may still be in checkpoint
        form: a new session finished at once puts back every layer no bucket reached (vLLM's finalize). The
        update itself failed, which the caller is told."""
        logger.error("a weight update failed inside vLLM; layers it reached may hold part of the new weights")
        for path in ("/start_weight_update", "/finish_weight_update"):
            try:
                await self.call("POST", path, json={"weight_version": None} if "finish" in path else None)
            except RequestError:
                pass
        self._session_open = False
        self._ready_event().set()


def _check_payloads(entries: list[str]) -> None:
    """What vLLM's worker will read, read here first with the same allow-list, so a bad payload is a 400
    naming the cause rather than a failed worker call."""
    from rayrl.weights.wire import WeightUpdateError, deserialize_entry

    try:
        for entry in entries:
            deserialize_entry(entry)
    except WeightUpdateError as err:
        raise RequestError(f"{err} (the vllm backend on CPU opens rayrl shared-memory buffers only)") from None


# -- the process -----------------------------------------------------------------------------------


async def _wait_for_vllm(adapter: VLLMAdapter, proc: subprocess.Popen, timeout_s: float,
                         output: VLLMOutput) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with status {proc.returncode} before it answered{output.why()}")
        try:
            await adapter.call("GET", "/health", timeout_s=5.0)
            break
        except (RequestError, aiohttp.ClientError, asyncio.TimeoutError):
            if loop.time() > deadline:
                raise SystemExit(f"vLLM did not answer /health within {timeout_s:.0f}s") from None
            await asyncio.sleep(1.0)
    spec = await adapter.call("GET", "/openapi.json", timeout_s=30.0)
    missing = [r for r in REQUIRED_ROUTES if r not in (spec or {}).get("paths", {})]
    if missing:
        raise SystemExit(f"this vLLM lacks routes the vllm backend needs: {', '.join(missing)} (vllm 0.32 with "
                         "VLLM_SERVER_DEV_MODE=1 serves them)")
    version = await adapter.call("GET", "/version", timeout_s=30.0)
    adapter.info["vllm_version"] = (version or {}).get("version") if isinstance(version, dict) else version


async def serve(args: argparse.Namespace) -> None:
    port = free_port()
    adapter = VLLMAdapter(f"http://127.0.0.1:{port}", args.model_path, args.tp_size, args.device,
                          {"context_length": args.context_length, "max_running_requests": args.max_batch_size,
                           "dtype": args.dtype})
    runner = web.AppRunner(adapter.app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()  # bound first: the port is ours while vLLM starts
    scratch = Path(tempfile.mkdtemp(prefix="rayrl-vllm-"))
    tokenizer = tokenizer_override(args.model_path, scratch / "tokenizer")
    if tokenizer:
        logger.info("the model's tokenizer_config names LlamaTokenizer over a byte-level BPE; vLLM gets a copy "
                    "naming the generic fast tokenizer: %s", tokenizer)
    command = vllm_command(args, port, tokenizer)
    logger.info("starting vLLM: %s", " ".join(command))
    proc = subprocess.Popen(command, env=vllm_env(args), preexec_fn=die_with_parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    output = VLLMOutput(proc)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await _wait_for_vllm(adapter, proc, args.startup_timeout, output)
        await adapter.call("POST", "/init_weight_transfer_engine", json={"init_info": {}})
        await adapter.call("POST", "/update_weight_version", json={"new_version": str(args.weight_version)})
        adapter.ready = True
        logger.info("serving rayrl's engine API on %s:%d over vLLM %s at 127.0.0.1:%d", args.host, args.port,
                    adapter.info.get("vllm_version"), port)
        while not stop.is_set() and proc.poll() is None:
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with status {proc.returncode}{output.why()}")
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        await adapter.close()
        await runner.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", required=True, help="the interpreter whose environment holds vllm")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--kv-cache-gb", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.7)
    p.add_argument("--weight-version", default="0")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("vllm_args", nargs="*", help="after --: passed to vLLM verbatim")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    sweep_quietly()  # weight buffers of senders that died on this node
    try:
        asyncio.run(serve(args))
    except SystemExit as err:
        if isinstance(err.code, str):
            print(f"vllm_adapter: {err.code}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        raise


if __name__ == "__main__":
    main()
