"""Gateway overhead, side by side in one run: a stub engine reached directly, through rayrl's gateway,
and through rllm-model-gateway (PyPI), all on loopback.

    python bench/gateway_overhead.py [--requests 400] [--seconds 6] [--concurrency 64]

The stub engine answers instantly with a fixed completion (8 token ids + log-probs): SGLang's
``/generate`` for rayrl (which renders the chat with the model's template, tokenizes, sends token ids
and records a TurnRecord per call) and vLLM's ``/v1/chat/completions`` with ``prompt_token_ids`` /
``token_ids`` / logprobs for rllm-model-gateway (a reverse proxy that stores one trace per call in
SQLite). Each server runs in its own process; the load generator is an aiohttp client in this process.

Reported: added latency p50/p99 at one client (gateway minus the stub endpoint it uses) and the most
requests/s at ``--concurrency`` clients, with ratios. Targets: rayrl's added p50 < 1 ms; rayrl's
throughput >= 5x rllm-model-gateway's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
OUTPUT_IDS = [28, 1530, 314, 253, 3526, 30, 2, 2]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France? Answer in one word."}]

STUB = textwrap.dedent('''
    import json, sys, time
    from aiohttp import web
    IDS = %r
    GEN = json.dumps({"text": "Paris.", "output_ids": IDS, "meta_info": {"id": "r", "finish_reason": {"type": "stop",
        "matched": 2}, "prompt_tokens": 30, "completion_tokens": len(IDS), "weight_version": "1",
        "output_token_logprobs": [[-0.1, i, None] for i in IDS]}}).encode()
    CHAT = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "stub",
        "prompt_token_ids": list(range(30)),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop",
                     "token_ids": IDS, "logprobs": {"content": [{"token": "x", "logprob": -0.1, "bytes": [120],
                     "top_logprobs": []} for _ in IDS]}}],
        "usage": {"prompt_tokens": 30, "completion_tokens": len(IDS), "total_tokens": 38}}).encode()
    async def gen(request):
        await request.read()
        return web.Response(body=GEN, content_type="application/json")
    async def chat(request):
        await request.read()
        return web.Response(body=CHAT, content_type="application/json")
    async def ok(request):
        return web.json_response({"status": "ok"})
    app = web.Application()
    app.router.add_post("/generate", gen)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/models", ok)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
''') % (OUTPUT_IDS,)

RAYRL = textwrap.dedent('''
    import asyncio, sys
    from transformers import AutoTokenizer
    from rayrl.config import GatewayConfig, TrajectoryConfig
    from rayrl.engines.router import Router
    from rayrl.gateway.app import Gateway
    async def main(port, stub, tokenizer_dir):
        router = Router([stub])
        gw = Gateway(GatewayConfig(tool_parser="hermes"), TrajectoryConfig(), AutoTokenizer.from_pretrained(tokenizer_dir),
                     router, model_name="stub", context_length=4096, admin_token="admin")
        await gw.start(port=port)
        print("ready", flush=True)
        await asyncio.Event().wait()
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
''')

RLLM = textwrap.dedent('''
    import logging, sys, uvicorn
    from rllm_model_gateway.models import GatewayConfig
    from rllm_model_gateway.server import create_app
    cfg = GatewayConfig(host="127.0.0.1", port=int(sys.argv[1]), workers=[{"url": sys.argv[2] + "/v1"}],
                        db_path=sys.argv[3], log_level="WARNING", health_check_interval=60.0)
    uvicorn.run(create_app(cfg), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


async def wait_up(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


class Target:
    """One endpoint to load: URL, headers and body per client index."""

    def __init__(self, name: str, url: str, body: dict, headers_for=None, url_for=None) -> None:
        self.name, self.url, self.body = name, url, json.dumps(body).encode()
        self.headers_for = headers_for or (lambda i: {})
        self.url_for = url_for or (lambda i: url)


async def one(session: aiohttp.ClientSession, target: Target, i: int) -> float:
    t0 = time.perf_counter()
    async with session.post(target.url_for(i), data=target.body,
                            headers={"Content-Type": "application/json", **target.headers_for(i)}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{target.name}: HTTP {r.status}")
    return time.perf_counter() - t0


async def latency(target: Target, n: int) -> list[float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        for _ in range(20):
            await one(s, target, 0)
        return [await one(s, target, 0) for _ in range(n)]


async def throughput(target: Target, clients: int, seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def client(i: int, s: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await one(s, target, i)
            done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(one(s, target, i) for i in range(clients)))  # warm connections
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i, s) for i in range(clients)))
        return done / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args: argparse.Namespace) -> None:
    from rayrl.models import provision_smollm2

    tokenizer_dir = str(provision_smollm2())
    ports = {k: free_port() for k in ("stub", "rayrl", "rllm")}
    stub_url = f"http://127.0.0.1:{ports['stub']}"
    tmp = tempfile.mkdtemp(prefix="gw-bench-")
    procs = [spawn(STUB, str(ports["stub"]))]
    try:
        await wait_up(stub_url + "/health")
        procs.append(spawn(RAYRL, str(ports["rayrl"]), stub_url, tokenizer_dir))
        rllm_ok = True
        try:
            import rllm_model_gateway  # noqa: F401

            procs.append(spawn(RLLM, str(ports["rllm"]), stub_url, os.path.join(tmp, "traces.db")))
        except ImportError as err:
            rllm_ok = False
            print(f"rllm-model-gateway is not installed ({err}); pip install rllm-model-gateway")
        rayrl_root = f"http://127.0.0.1:{ports['rayrl']}"
        await wait_up(rayrl_root + "/health")
        if rllm_ok:
            await wait_up(f"http://127.0.0.1:{ports['rllm']}/health")

        # one gateway session per client: what a training run looks like
        async with aiohttp.ClientSession() as s:
            tokens = []
            for _ in range(max(args.concurrency, 1)):
                async with s.post(rayrl_root + "/rayrl/sessions", json={}, headers={"Authorization": "Bearer admin"}) as r:
                    tokens.append((await r.json())["token"])
        chat = {"model": "stub", "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0}
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
        targets = {
            "stub /generate": Target("stub /generate", stub_url + "/generate",
                                     {"input_ids": ids, "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}),
            "rayrl gateway": Target("rayrl gateway", rayrl_root + "/v1/chat/completions", chat,
                                    headers_for=lambda i: {"Authorization": f"Bearer {tokens[i % len(tokens)]}"}),
            "stub /v1/chat": Target("stub /v1/chat", stub_url + "/v1/chat/completions", chat),
        }
        if rllm_ok:
            rllm_root = f"http://127.0.0.1:{ports['rllm']}"
            targets["rllm-model-gateway"] = Target(
                "rllm-model-gateway", "", chat, url_for=lambda i: f"{rllm_root}/sessions/s{i}/v1/chat/completions")
        lat = {name: await latency(t, args.requests) for name, t in targets.items()}
        rps = {name: await throughput(t, args.concurrency, args.seconds) for name, t in targets.items()}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    ms = {k: [x * 1000 for x in v] for k, v in lat.items()}
    print(f"\n{'endpoint':<22}{'p50 ms':>9}{'p99 ms':>9}{'req/s @' + str(args.concurrency):>12}")
    for name in targets:
        print(f"{name:<22}{statistics.median(ms[name]):>9.3f}{pct(ms[name], 0.99):>9.3f}{rps[name]:>12.0f}")
    ours = (statistics.median(ms["rayrl gateway"]) - statistics.median(ms["stub /generate"]),
            pct(ms["rayrl gateway"], 0.99) - pct(ms["stub /generate"], 0.99))
    print(f"\nrayrl added latency @1 client: p50 {ours[0]:.3f} ms, p99 {ours[1]:.3f} ms "
          f"(target p50 < 1 ms: {'met' if ours[0] < 1.0 else 'NOT met'})")
    if "rllm-model-gateway" in targets:
        theirs = (statistics.median(ms["rllm-model-gateway"]) - statistics.median(ms["stub /v1/chat"]),
                  pct(ms["rllm-model-gateway"], 0.99) - pct(ms["stub /v1/chat"], 0.99))
        ratio = rps["rayrl gateway"] / rps["rllm-model-gateway"]
        print(f"rllm-model-gateway added latency @1 client: p50 {theirs[0]:.3f} ms, p99 {theirs[1]:.3f} ms")
        print(f"added p50 ratio rllm/rayrl: {theirs[0] / max(ours[0], 1e-6):.1f}x")
        print(f"throughput @{args.concurrency}: rayrl {rps['rayrl gateway']:.0f} req/s vs rllm-model-gateway "
              f"{rps['rllm-model-gateway']:.0f} req/s = {ratio:.1f}x (target >= 5x: {'met' if ratio >= 5 else 'NOT met'})")
    print(f"gateway throughput / stub alone: {rps['rayrl gateway'] / rps['stub /generate']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="sequential requests per endpoint for latency")
    ap.add_argument("--seconds", type=float, default=6.0, help="duration of each throughput run")
    ap.add_argument("--concurrency", type=int, default=64)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
