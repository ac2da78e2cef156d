"""Gateway overhead, side by side in one run: a stub engine reached directly, through rayrl's gateway,
and through rllm-model-gateway (PyPI), all on loopback.

    python bench/gateway_overhead.py [--requests 100] [--seconds 2] [--concurrency 64] [--quick]

The stub engine answers instantly with a fixed completion (8 token ids + log-probs): SGLang's
``/generate`` for rayrl (which renders the chat with the model's template, tokenizes, sends token ids,
reads the answer as SGLang's stream, one chunk per token, and records a TurnRecord per call; the stub's
own figure is a plain ``/generate``, what a caller without a gateway would send) and vLLM's
``/v1/chat/completions`` with ``prompt_token_ids`` /
``token_ids`` / logprobs for rllm-model-gateway (a reverse proxy that stores one trace per call).
rllm-model-gateway runs in its fastest documented configuration: its in-memory trace store
(``store_worker="memory"``, ``--store memory`` on its command line; SQLite is its default), traces
written in the background (``sync_traces`` off, its default). Each server runs in its own process;
the load generator is an aiohttp client in this process.

Each round measures every endpoint once, the order rotating from round to round (bench/measure.py):
``--requests`` sequential calls at one client (p50 and p99 latency of that block) and ``--seconds`` of
load from ``--concurrency`` clients (requests/s), and each server's CPU time per call in the one-client
block (its main thread's, from Linux's schedstat: what the server's own work costs, which a busy
machine stretches far less than it stretches latency). Reported: the median and spread of those per-round
figures, rayrl's and rllm-model-gateway's added latency (gateway minus the stub endpoint it uses, per
round) and the per-round throughput ratio. Targets (issue 46): rayrl's added p50 < 0.7 ms, added p99 < 2 ms,
server CPU per call < 0.6 ms (medians over the rounds); rayrl's throughput >= 5x rllm-model-gateway's.
``--baseline DIR`` adds the gateway of another checkout (a git worktree of main, say) as one more
endpoint, so a change is measured against what it replaces in the same alternation.
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
import textwrap
import time
from pathlib import Path

import aiohttp
from measure import Record, Spread, add_common_args, alternate, paired_ratio

REPO = Path(__file__).resolve().parents[1]
BASELINE = "rayrl gateway (baseline)"
OUTPUT_IDS = [28, 1530, 314, 253, 3526, 30, 2, 2]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France? Answer in one word."}]
CHAT_CALL = {"model": "stub", "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0}  # the benches' LLM call

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
    # streaming (the gateway always streams from its engines): one cumulative chunk per token, as SGLang
    # sends them by default, then [DONE]
    CHUNKS = [b"data: " + json.dumps({"text": "Paris."[:k], "output_ids": IDS[:k], "meta_info": {
        "id": "r", "finish_reason": {"type": "stop", "matched": 2} if k == len(IDS) else None,
        "prompt_tokens": 30, "completion_tokens": k, "weight_version": "1",
        "output_token_logprobs": [[-0.1, i, None] for i in IDS[:k]]}}).encode() + b"\\n\\n"
        for k in range(1, len(IDS) + 1)] + [b"data: [DONE]\\n\\n"]
    async def gen(request):
        if not json.loads(await request.read()).get("stream"):
            return web.Response(body=GEN, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in CHUNKS:
            await resp.write(chunk)
        await resp.write_eof()
        return resp
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
        gw = Gateway(GatewayConfig(tool_parser="hermes"), TrajectoryConfig(),
                     AutoTokenizer.from_pretrained(tokenizer_dir), router, model_name="stub", context_length=4096,
                     admin_token="admin")
        await gw.start(port=port)
        try:  # as the gateway's hosts do (a baseline checkout may predate it)
            from rayrl.gateway.app import settle_heap
            settle_heap()
        except ImportError:
            pass
        print("ready", flush=True)
        await asyncio.Event().wait()
    try:  # the loop the gateway's hosts run it on (a baseline checkout may predate event_loop.py)
        from rayrl.gateway.event_loop import run
    except ImportError:
        run = asyncio.run
    run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
''')

RLLM = textwrap.dedent('''
    import logging, sys, uvicorn
    from rllm_model_gateway.models import GatewayConfig
    from rllm_model_gateway.server import create_app
    cfg = GatewayConfig(host="127.0.0.1", port=int(sys.argv[1]), workers=[{"url": sys.argv[2] + "/v1"}],
                        store_worker="memory", log_level="WARNING", health_check_interval=60.0)
    uvicorn.run(create_app(cfg), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(code: str, *args: str, tree: Path = REPO) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=tree, stdout=subprocess.DEVNULL,
                            text=True, env={**os.environ, "PYTHONPATH": str(tree)})


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Terminate every server process, then kill any that has not exited within 10 s."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


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


WARMUP = 5  # requests before each latency block


def cpu_seconds(pid: int) -> float:
    """CPU time of a server's main thread so far (Linux schedstat, in ns; NaN elsewhere): the work a server
    does per call, a figure the machine's load stretches far less than latency."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return float("nan")


async def latency(target: Target, n: int) -> list[float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        for _ in range(WARMUP):
            await one(s, target, 0)
        return [await one(s, target, 0) for _ in range(n)]


async def throughput(target: Target, clients: int, seconds: float) -> float:
    done = 0
    stop = 0.0

    async def client(i: int, s: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await one(s, target, i)
            done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(one(s, target, i) for i in range(clients)))  # warm connections
        t0 = time.perf_counter()
        stop = t0 + seconds
        await asyncio.gather(*(client(i, s) for i in range(clients)))
        return done / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def start_servers(procs: list[subprocess.Popen], ports: dict[str, int], tokenizer_dir: str,
                        baseline: Path | None = None) -> bool:
    """Start the stub, rayrl's gateway (and the baseline checkout's) and (when installed)
    rllm-model-gateway; True if rllm is up."""
    stub_url = f"http://127.0.0.1:{ports['stub']}"
    procs.append(spawn(STUB, str(ports["stub"])))
    await wait_up(stub_url + "/health")
    procs.append(spawn(RAYRL, str(ports["rayrl"]), stub_url, tokenizer_dir))
    if baseline is not None:
        procs.append(spawn(RAYRL, str(ports["baseline"]), stub_url, tokenizer_dir, tree=baseline))
        await wait_up(f"http://127.0.0.1:{ports['baseline']}/health")
    try:
        import rllm_model_gateway  # noqa: F401
    except ImportError as err:
        print(f"rllm-model-gateway is not installed ({err}): pip install -e '.[bench]'")
        rllm_ok = False
    else:
        procs.append(spawn(RLLM, str(ports["rllm"]), stub_url))
        rllm_ok = True
    await wait_up(f"http://127.0.0.1:{ports['rayrl']}/health")
    if rllm_ok:
        await wait_up(f"http://127.0.0.1:{ports['rllm']}/health")
    return rllm_ok


async def _gateway_target(name: str, root: str, clients: int, chat: dict) -> Target:
    """Chat Completions on a rayrl gateway, one gateway session per client: what a training run looks like."""
    async with aiohttp.ClientSession() as s:
        tokens = []
        for _ in range(max(clients, 1)):
            async with s.post(root + "/rayrl/sessions", json={}, headers={"Authorization": "Bearer admin"}) as r:
                tokens.append((await r.json())["token"])
    return Target(name, root + "/v1/chat/completions", chat,
                  headers_for=lambda i: {"Authorization": f"Bearer {tokens[i % len(tokens)]}"})


async def make_targets(ports: dict[str, int], tokenizer_dir: str, clients: int, rllm_ok: bool) -> dict[str, Target]:
    from transformers import AutoTokenizer

    stub_url = f"http://127.0.0.1:{ports['stub']}"
    ids = AutoTokenizer.from_pretrained(tokenizer_dir).apply_chat_template(MESSAGES, add_generation_prompt=True)
    targets = {
        "stub /generate": Target("stub /generate", stub_url + "/generate",
                                 {"input_ids": ids, "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}),
        "rayrl gateway": await _gateway_target("rayrl gateway", f"http://127.0.0.1:{ports['rayrl']}", clients,
                                               CHAT_CALL),
        "stub /v1/chat": Target("stub /v1/chat", stub_url + "/v1/chat/completions", CHAT_CALL),
    }
    if "baseline" in ports:
        targets[BASELINE] = await _gateway_target(BASELINE, f"http://127.0.0.1:{ports['baseline']}", clients, CHAT_CALL)
    if rllm_ok:
        rllm_root = f"http://127.0.0.1:{ports['rllm']}"
        targets["rllm-model-gateway"] = Target(
            "rllm-model-gateway", "", CHAT_CALL, url_for=lambda i: f"{rllm_root}/sessions/s{i}/v1/chat/completions")
    return targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100, help="sequential requests per endpoint per round")
    ap.add_argument("--seconds", type=float, default=2.0, help="duration of each throughput block")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--baseline", type=Path, default=None,
                    help="also run the gateway of another checkout (e.g. a git worktree of main), in alternation")
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.seconds = 20, 0.5
    rounds = dict(min_rounds=2, max_rounds=2) if args.quick else dict(min_rounds=5, max_rounds=9, budget_s=100)
    from rayrl.models import provision_smollm2

    record = Record("gateway_overhead", "Gateway overhead: rayrl against rllm-model-gateway (memory store)",
                    quick=args.quick, record_dir=args.record_dir)
    tokenizer_dir = str(provision_smollm2())
    ports = {k: free_port() for k in ("stub", "rayrl", "rllm") + (("baseline",) if args.baseline else ())}
    procs: list[subprocess.Popen] = []
    loop = asyncio.new_event_loop()
    try:
        rllm_ok = loop.run_until_complete(start_servers(procs, ports, tokenizer_dir, args.baseline))
        targets = loop.run_until_complete(make_targets(ports, tokenizer_dir, args.concurrency, rllm_ok))

        pids = {"stub /generate": procs[0].pid, "stub /v1/chat": procs[0].pid, "rayrl gateway": procs[1].pid}
        if args.baseline:
            pids[BASELINE] = procs[2].pid
        if rllm_ok:
            pids["rllm-model-gateway"] = procs[-1].pid

        def side(target: Target):
            def go() -> dict[str, float]:
                cpu0 = cpu_seconds(pids[target.name])
                ms = [x * 1e3 for x in loop.run_until_complete(latency(target, args.requests))]
                cpu = (cpu_seconds(pids[target.name]) - cpu0) / (args.requests + WARMUP) * 1e3
                rps = loop.run_until_complete(throughput(target, args.concurrency, args.seconds))
                return {"p50": statistics.median(ms), "p99": pct(ms, 0.99), "rps": rps, "cpu": cpu}
            return go

        res = alternate({name: side(t) for name, t in targets.items()}, label="endpoints", **rounds)
    finally:
        loop.close()
        stop_all(procs)
    if args.baseline:
        record.note(f"baseline: the gateway of {args.baseline} ({baseline_commit(args.baseline)}), same stub")
    report(record, res, args.concurrency, args.requests, args.seconds)
    record.save()


def baseline_commit(tree: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    return out.stdout.strip()[:80] or "not a git checkout"


def report(record: Record, res: dict, clients: int, requests: int, seconds: float) -> None:
    record.table(f"per endpoint, median [IQR] (min-max, n) of per-round figures; a round = {requests} sequential "
                 f"requests (p50/p99 of that block) + {seconds:g} s at {clients} clients",
                 ["endpoint", "p50 ms", "p99 ms", f"req/s @{clients}", "server CPU ms/call (1 client)"],
                 [[name, r["p50"].fmt(3), r["p99"].fmt(3), r["rps"].fmt(0), r["cpu"].fmt(3)]
                  for name, r in res.items()])
    rows = []

    def added(gateway: str, stub: str) -> tuple:
        return tuple(Spread(tuple(g - s for g, s in zip(res[gateway][k].samples, res[stub][k].samples)))
                     for k in ("p50", "p99"))

    ours = added("rayrl gateway", "stub /generate")
    rows.append(["rayrl gateway", ours[0].fmt(3), ours[1].fmt(3),
                 paired_ratio(res["rayrl gateway"]["rps"], res["stub /generate"]["rps"]).fmt(3)])
    record.figure("rayrl_added_p50_ms", ours[0])
    record.figure("rayrl_cpu_ms_per_call", res["rayrl gateway"]["cpu"])
    record.figure("rayrl_added_p99_ms", ours[1])
    cpu = res["rayrl gateway"]["cpu"].median
    verdicts = [f"rayrl added p50 < 0.7 ms: {'met' if ours[0].median < 0.7 else 'NOT met'}",
                f"added p99 < 2 ms: {'met' if ours[1].median < 2.0 else 'NOT met'}",
                f"server CPU per call < 0.6 ms: {'met' if cpu < 0.6 else 'NOT met'} ({cpu:.3f})"]
    if BASELINE in res:
        base = added(BASELINE, "stub /generate")
        rows.append([BASELINE, base[0].fmt(3), base[1].fmt(3),
                     paired_ratio(res[BASELINE]["rps"], res["stub /generate"]["rps"]).fmt(3)])
        record.figure("baseline_added_p50_ms", base[0])
        record.figure("baseline_cpu_ms_per_call", res[BASELINE]["cpu"])
        record.figure("throughput_ratio_rayrl_over_baseline", paired_ratio(res["rayrl gateway"]["rps"],
                                                                           res[BASELINE]["rps"]))
    if "rllm-model-gateway" in res:
        theirs = added("rllm-model-gateway", "stub /v1/chat")
        rows.append(["rllm-model-gateway (memory store)", theirs[0].fmt(3), theirs[1].fmt(3),
                     paired_ratio(res["rllm-model-gateway"]["rps"], res["stub /v1/chat"]["rps"]).fmt(3)])
        ratio = paired_ratio(res["rayrl gateway"]["rps"], res["rllm-model-gateway"]["rps"])
        record.figure("throughput_ratio_rayrl_over_rllm", ratio)
        if BASELINE in res:
            base_ratio = paired_ratio(res[BASELINE]["rps"], res["rllm-model-gateway"]["rps"])
            record.figure("throughput_ratio_baseline_over_rllm", base_ratio)
            record.note(f"baseline/rllm throughput at {clients} clients {base_ratio.fmt(2, 'x')}")
        verdicts.append(f"rayrl/rllm throughput at {clients} clients {ratio.fmt(2, 'x')} >= 5x: "
                        f"{'met' if ratio.median >= 5 else 'NOT met'}")
    record.table("added by the gateway (gateway minus the stub endpoint it calls, per round) and throughput as a "
                 "share of the stub's alone", ["gateway", "added p50 ms", "added p99 ms", "req/s / stub alone"], rows)
    record.note("targets: " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
