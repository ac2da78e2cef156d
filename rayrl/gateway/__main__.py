"""Standalone gateway: a trace-capturing OpenAI/Anthropic-compatible proxy in front of a CPU engine.

    python -m rayrl.gateway serve --model PATH --host 127.0.0.1 --port 8000
    python -m rayrl.gateway serve --model PATH --engine-url http://127.0.0.1:30000   # an existing engine

It prints an admin token. ``POST /rayrl/sessions`` (admin token) returns ``{session_id, token,
base_url}``; agents use ``token`` as their API key; ``POST /rayrl/sessions/{id}/finish`` with
``{"reward": r}`` returns the session's samples as JSON.

Defaults fit real agents: the context length is the model's own maximum (agent CLIs send a 7-20K-token
first prompt), taken from the engine when it runs elsewhere (``/get_server_info``), else from the model's
config; ``--context-length`` sets it for both. Non-2xx answers are logged, one line each (INFO).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from rayrl.config import GatewayConfig, TrajectoryConfig
from rayrl.gateway import event_loop

logger = logging.getLogger("rayrl.gateway")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m rayrl.gateway")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the gateway (and a CPU engine unless --engine-url)")
    serve.add_argument("--model", required=True, help="HF model directory or smollm2-135m-instruct")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--engine-url", action="append", default=[], help="use running engine(s) instead")
    serve.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                       help="the CPU engine's dtype (auto: bfloat16 where the CPU computes it natively)")
    serve.add_argument("--context-length", type=int, default=None,
                       help="longest prompt + response (default: the model's own maximum)")
    serve.add_argument("--tool-parser", default="auto", choices=["auto", "hermes", "llama3", "none"])
    serve.add_argument("--admin-token", default=None, help="default: a fresh random token")
    serve.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    if args.context_length is not None and args.context_length < 2:
        ap.error("--context-length must be at least 2")
    return args


def model_max_length(model_config: Any) -> int | None:
    """The longest sequence a model's config says it takes (None when it does not say)."""
    value = getattr(model_config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


async def engine_context_length(router: Any) -> int | None:
    """The smallest context length the running engines report (SGLang and the CPU engine both answer
    ``/get_server_info``), or None when none says."""
    found = []
    for url, client in router.clients.items():
        try:
            info = await client.get_server_info()
        except Exception as err:  # an engine that does not say: the model's config decides
            logger.warning("could not read the context length from %s: %s", url, err)
            continue
        value = info.get("context_length") if isinstance(info, dict) else None
        if not isinstance(value, int) and isinstance(info, dict) and isinstance(info.get("max_req_input_len"), int):
            value = info["max_req_input_len"] + 1
        if isinstance(value, int) and value > 1:
            found.append(value)
    return min(found) if found else None


async def serve(args: argparse.Namespace) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from rayrl.engines.router import Router
    from rayrl.gateway.app import Gateway, settle_heap
    from rayrl.models import resolve_model_path

    path = resolve_model_path(args.model)
    model_config = AutoConfig.from_pretrained(path)
    engine = server = None
    urls = list(args.engine_url)
    context_length = args.context_length
    if not urls:
        from rayrl.engines.cpu.engine import CPUEngine
        from rayrl.engines.cpu.server import EngineServer
        from rayrl.machine import compute_dtype, cpu_has_native_bf16

        dtype = args.dtype if args.dtype != "auto" else compute_dtype("auto", cuda=False,
                                                                      native_bf16=cpu_has_native_bf16())
        engine = CPUEngine(path, dtype=dtype, context_length=context_length, weight_format="auto").start()
        context_length = engine.context_length
        server = EngineServer(engine)
        urls = [await server.start()]
    router = Router(urls)
    if context_length is None:
        context_length = await engine_context_length(router) or model_max_length(model_config) or 4096
    gateway = Gateway(
        GatewayConfig(host=args.host, port=args.port, tool_parser=args.tool_parser),
        TrajectoryConfig(),
        AutoTokenizer.from_pretrained(path),
        router,
        model_name=args.model,
        context_length=context_length,
        admin_token=args.admin_token,
        model_type=getattr(model_config, "model_type", ""),
    )
    base_url = await gateway.start()
    settle_heap()
    print(f"rayrl gateway at {base_url} (engines: {', '.join(urls)}; context length {context_length})", flush=True)
    print(f"admin token: {gateway.admin_token}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await gateway.stop()
        await router.close()
        if server is not None:
            await server.stop()
        if engine is not None:
            await loop.run_in_executor(None, engine.shutdown)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    event_loop.run(serve(args))  # Ray's loop for async actors: uvloop when installed
    return 0


if __name__ == "__main__":
    sys.exit(main())
