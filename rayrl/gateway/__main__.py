"""Standalone gateway: a trace-capturing OpenAI-compatible proxy in front of a CPU engine.

    python -m rayrl.gateway serve --model PATH --host 127.0.0.1 --port 8000
    python -m rayrl.gateway serve --model PATH --engine-url http://127.0.0.1:30000   # an existing engine

It prints an admin token. ``POST /rayrl/sessions`` (admin token) returns ``{session_id, token,
base_url}``; agents use ``token`` as their API key; ``POST /rayrl/sessions/{id}/finish`` with
``{"reward": r}`` returns the session's samples as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from rayrl.config import GatewayConfig, TrajectoryConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m rayrl.gateway")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the gateway (and a CPU engine unless --engine-url)")
    serve.add_argument("--model", required=True, help="HF model directory or smollm2-135m-instruct")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--engine-url", action="append", default=[], help="use running engine(s) instead")
    serve.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    serve.add_argument("--context-length", type=int, default=4096)
    serve.add_argument("--tool-parser", default="auto", choices=["auto", "hermes", "llama3", "none"])
    serve.add_argument("--admin-token", default=None, help="default: a fresh random token")
    return ap.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from rayrl.engines.router import Router
    from rayrl.gateway.app import Gateway
    from rayrl.models import resolve_model_path

    path = resolve_model_path(args.model)
    engine = server = None
    urls = list(args.engine_url)
    if not urls:
        from rayrl.engines.cpu_engine import CPUEngine
        from rayrl.engines.server import EngineServer

        engine = CPUEngine(path, dtype=args.dtype, context_length=args.context_length).start()
        server = EngineServer(engine)
        urls = [await server.start()]
    router = Router(urls)
    gateway = Gateway(
        GatewayConfig(host=args.host, port=args.port, tool_parser=args.tool_parser),
        TrajectoryConfig(),
        AutoTokenizer.from_pretrained(path),
        router,
        model_name=args.model,
        context_length=args.context_length,
        admin_token=args.admin_token,
        model_type=getattr(AutoConfig.from_pretrained(path), "model_type", ""),
    )
    base_url = await gateway.start()
    print(f"rayrl gateway at {base_url} (engines: {', '.join(urls)})", flush=True)
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
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
