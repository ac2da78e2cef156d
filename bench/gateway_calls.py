"""Python calls per request in the gateway, counted by cProfile: a figure no load changes, when the engine's
stream arrives the same way every time.

    PYTHONPATH=<checkout> python bench/gateway_calls.py [--requests 500] [--stub bench|one-write]

The gateway of the checkout on ``PYTHONPATH`` runs in this process (its event loop in the main thread,
profiled); the overhead bench's stub engine in a process of its own; a client (aiohttp, one keep-alive
connection, the overhead bench's Chat Completions call, sequential) in a thread of this process with its
own event loop, which cProfile does not see (it profiles the thread that enabled it). Printed: the calls
per request (cProfile counts every resumption of a coroutine as a call), and the functions whose calls per
request are highest.

Why ``--stub one-write`` (the default): the bench's stub writes its nine stream chunks one by one, and
whether they reach the gateway in one read or nine depends on how the two processes are scheduled, so the
gateway's calls per request (each read costs a few dozen) move with the machine's load. The one-write stub
sends the same bytes in one write: one read, every time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import threading
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_overhead import CHAT_CALL, STUB, free_port, spawn, wait_up  # noqa: E402

ONE_WRITE_STUB = STUB.replace("    for chunk in CHUNKS:\n        await resp.write(chunk)\n",
                              "    await resp.write(b''.join(CHUNKS))\n")
assert ONE_WRITE_STUB != STUB, "the stub's stream loop moved: update gateway_calls.py"


def client(url: str, token: str, n: int, ready: threading.Event, go: threading.Event, done: list) -> None:
    async def run() -> None:
        body = json.dumps(CHAT_CALL).encode()
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
            async def one() -> None:
                async with s.post(url, data=body, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
            for _ in range(20):
                await one()
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            for _ in range(n):
                await one()
            done.append(n)

    asyncio.run(run())


async def main(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from rayrl.config import GatewayConfig, TrajectoryConfig
    from rayrl.engines.router import Router
    from rayrl.gateway.app import Gateway
    from rayrl.models import provision_smollm2

    stub_port = free_port()
    stub = spawn(ONE_WRITE_STUB if args.stub == "one-write" else STUB, str(stub_port))
    try:
        stub_url = f"http://127.0.0.1:{stub_port}"
        await wait_up(stub_url + "/health")
        router = Router([stub_url])
        gateway = Gateway(GatewayConfig(tool_parser="hermes"), TrajectoryConfig(),
                          AutoTokenizer.from_pretrained(str(provision_smollm2())), router, model_name="stub",
                          context_length=4096, admin_token="admin")
        base = await gateway.start(host="127.0.0.1", port=0)
        try:
            from rayrl.gateway.app import settle_heap
            settle_heap()
        except ImportError:
            pass
        ready, go, done = threading.Event(), threading.Event(), []
        thread = threading.Thread(target=client, args=(base + "/chat/completions", gateway.open_session().token,
                                                       args.requests, ready, go, done))
        thread.start()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, ready.wait)
        profiler = cProfile.Profile()
        profiler.enable()
        go.set()
        while not done and thread.is_alive():
            await asyncio.sleep(0.05)
        profiler.disable()
        thread.join()
        await gateway.stop()
        await router.close()
    finally:
        stub.kill()
        stub.wait()
    stats = pstats.Stats(profiler)
    n = args.requests
    print(f"{stats.total_calls / n:.1f} Python calls per request ({n} requests, stub: {args.stub})")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][1])[:args.top]
    for (path, line, name), (_, calls, *_rest) in rows:
        print(f"  {calls / n:7.2f}  {Path(path).name}:{line}:{name}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--stub", choices=["one-write", "bench"], default="one-write")
    ap.add_argument("--top", type=int, default=0, help="list this many functions by calls per request")
    try:  # the loop the gateway's hosts run it on (a checkout may predate event_loop.py)
        from rayrl.gateway.event_loop import run
    except ImportError:
        run = asyncio.run
    run(main(ap.parse_args()))
