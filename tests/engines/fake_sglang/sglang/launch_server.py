"""``python -m sglang.launch_server`` stand-in: SGLang's flags in, the CPU engine's HTTP API out.

Flags SGLang has but the CPU engine cannot honour (``--tp-size``, ``--mem-fraction-static``,
``--enable-memory-saver``) are accepted and reported back in ``/get_server_info``, as SGLang reports its
ServerArgs there, so a test can check what the launcher passed. Unknown flags fail, as in SGLang.
"""

from __future__ import annotations

import argparse
import asyncio
import signal


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sglang.launch_server (rayrl test stand-in)")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float, default=None)
    ap.add_argument("--enable-memory-saver", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--max-running-requests", type=int, default=32)
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    return ap.parse_args()


async def serve(args: argparse.Namespace) -> None:
    from rayrl.engines.cpu.engine import CPUEngine
    from rayrl.engines.cpu.server import EngineServer
    from rayrl.models import resolve_model_path

    path = resolve_model_path(args.model_path)
    dtype = "float32" if args.dtype == "auto" else args.dtype
    engine = CPUEngine(
        path,
        dtype=dtype,
        max_batch_size=args.max_running_requests,
        context_length=args.context_length,
        num_threads=1,
        weight_version=args.weight_version,
    ).start()
    server_args = {k: v for k, v in vars(args).items()}
    server = EngineServer(engine, host=args.host, port=args.port, server_args=server_args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    url = await server.start()
    print(f"sglang stand-in (rayrl CPU engine) ready at {url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
        await loop.run_in_executor(None, engine.shutdown)


if __name__ == "__main__":
    asyncio.run(serve(parse_args()))
