"""Gateway soak: many concurrent sessions, each several multi-turn calls, then every session finished.

    python bench/gateway_soak.py [--sessions 1000] [--turns 3] [--big-body-mb 20]

Three processes on loopback: the scripted engine (tests/gateway/scripted_engine.py: a real HTTP server
speaking SGLang's ``/generate``, streaming too, that answers at once, so what is measured is the
gateway's own capacity), the standalone gateway (``python -m rayrl.gateway serve --engine-url``) and
this load generator (aiohttp). Session i speaks one API (Chat Completions, Anthropic Messages,
Responses, by i mod 3), streams or not (by i // 3 mod 2), and replays its whole history each turn as
real clients do. Every user message carries a tag ``[soak s<i> t<j>]``; the engine answers
``Noted s<i> t<j>.`` and records how long it spent on that tag, so each call's latency added by the
gateway is its end-to-end time at the client less the engine's time for that very call.

Once a session's turns are done it is finished (``POST /rayrl/sessions/{id}/finish``); its samples
come back and the generated (loss-masked) text is searched for each turn's answer: a turn answered
200 whose answer is not in the samples exactly once is lost or duplicated.

Printed: the date and the machine's load average at start and end, turns sent, turns answered 200,
turns recorded, lost (must be 0), duplicated (0), failed calls, p50/p99 latency added by the gateway
(with every session at once, which is mostly queueing on a small machine, and one call at a time before
the soak), /health p50/p99 during the soak and while one ``--big-body-mb`` body is processed, the
gateway's peak RSS, and its open file descriptors before the sessions, at the peak, and after every
session finished and the client closed its connections (the growth must be 0).

``/health`` is polled from a process of its own (``gateway_soak.py health URL``), on its own
connection: polled from the load generator, its latency would include the load generator's own event
loop, busy with a thousand sessions, instead of the gateway's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from gateway_proc import start_gateway

REPO = Path(__file__).resolve().parents[1]
TAG = re.compile(r"\[soak s(\d+) t(\d+)\]")
ANSWER = re.compile(r"Noted s(\d+) t(\d+)\.")
SYSTEM = ("You are a careful assistant in a long-running soak test. Answer every message briefly, keep the "
          "conversation going, and never call a tool unless asked. " * 4).strip()
APIS = ("chat", "messages", "responses")
ADMIN = {"Authorization": "Bearer admin"}


# -- the engine process ------------------------------------------------------------------------------


def serve_engine(tokenizer_dir: str) -> None:
    """The scripted engine, answering each tagged prompt with its tag and timing each call."""
    sys.path.insert(0, str(REPO))
    from aiohttp import web
    from transformers import AutoTokenizer

    from tests.gateway.scripted_engine import ScriptedEngine

    current: contextvars.ContextVar[dict] = contextvars.ContextVar("soak_call")

    def script(prompt: str) -> str:
        tags = TAG.findall(prompt)
        tag = f"s{tags[-1][0]} t{tags[-1][1]}" if tags else "none"
        current.get()["tag"] = tag
        return f"Noted {tag}."

    class TimedEngine(ScriptedEngine):
        """Keeps only the last prompt (the soak sends thousands) and each tag's time in the engine."""

        def __init__(self) -> None:
            super().__init__(AutoTokenizer.from_pretrained(tokenizer_dir), script)
            self.times: dict[str, float] = {}

        async def _generate(self, request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            box: dict[str, str] = {}
            current.set(box)
            try:
                return await super()._generate(request)
            finally:
                self.prompts.clear()
                self.times[box.get("tag", "none")] = time.perf_counter() - started

    async def main() -> None:
        engine = TimedEngine()
        url = await engine.start()
        timings = web.Application()  # the engine's routes are its own: the timings get a second, tiny server
        timings.router.add_get("/soak_timings", lambda r: web.json_response(engine.times))
        runner = web.AppRunner(timings, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"ready {url} http://127.0.0.1:{port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# -- the load generator ------------------------------------------------------------------------------


class Calls:
    """Per-call outcomes of the whole soak."""

    def __init__(self) -> None:
        self.sent = 0
        self.ok: dict[str, float] = {}  # tag -> end-to-end seconds of a call answered 200
        self.failed: list[str] = []
        self.recorded = 0
        self.found: dict[str, int] = {}  # tag -> times its answer is in the session's generated tokens


def _request(api: str, history: list[dict[str, Any]], stream: bool) -> tuple[str, dict[str, Any]]:
    if api == "chat":
        return "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "system", "content": SYSTEM}, *history],
                                        "max_tokens": 32, "stream": stream}
    if api == "messages":
        return "/v1/messages", {"model": "tiny", "system": SYSTEM, "messages": history, "max_tokens": 32,
                                "stream": stream}
    return "/v1/responses", {"model": "tiny", "instructions": SYSTEM, "input": history, "max_output_tokens": 32,
                             "stream": stream}


def _answer_of(api: str, body: dict[str, Any]) -> str:
    if api == "chat":
        return body["choices"][0]["message"]["content"]
    if api == "messages":
        return "".join(b["text"] for b in body["content"] if b["type"] == "text")
    return "".join(c["text"] for item in body["output"] if item["type"] == "message" for c in item["content"])


async def _streamed_answer(api: str, resp: aiohttp.ClientResponse) -> str:
    text, done = [], False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if api == "chat":
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            text.append(event["choices"][0]["delta"].get("content") or "" if event["choices"] else "")
        elif api == "messages":
            if event["type"] == "error":
                raise RuntimeError(event["error"]["message"])
            if event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
                text.append(event["delta"]["text"])
            done |= event["type"] == "message_stop"
        else:
            if event["type"] == "response.failed":
                raise RuntimeError(json.dumps(event["response"].get("error")))
            if event["type"] == "response.output_text.delta":
                text.append(event["delta"])
            done |= event["type"] == "response.completed"
    if not done:
        raise RuntimeError("the stream ended before its last event")
    return "".join(text)


def _generated_text(sample: dict[str, Any], tokenizer: Any) -> str:
    """The loss-masked (generated) parts of a sample, decoded, one run of tokens at a time."""
    response = sample["tokens"][sample["prompt_length"]:]
    runs, run = [], []
    for tok, mask in zip(response, sample["loss_mask"]):
        if mask:
            run.append(tok)
        elif run:
            runs.append(run)
            run = []
    runs.append(run)
    return "\n".join(tokenizer.decode(r) for r in runs if r)


async def session(http: aiohttp.ClientSession, root: str, i: int, turns: int, calls: Calls, tokenizer: Any) -> None:
    api, stream = APIS[i % 3], (i // 3) % 2 == 1
    async with http.post(root + "/rayrl/sessions", json={"metadata": {"soak": i}}, headers=ADMIN) as r:
        info = await r.json()
    headers = {"Authorization": f"Bearer {info['token']}", "x-api-key": info["token"]}
    history: list[dict[str, Any]] = []
    for t in range(turns):
        tag = f"s{i} t{t}"
        history.append({"role": "user", "content": f"[soak {tag}] Please note turn {t} of session {i}."})
        path, body = _request(api, history, stream)
        calls.sent += 1
        started = time.perf_counter()
        try:
            async with http.post(root + path, json=body, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                answer = await _streamed_answer(api, r) if stream else _answer_of(api, await r.json())
        except Exception as err:  # a failed call is counted; the session goes on as an agent would
            calls.failed.append(f"{api}{' stream' if stream else ''} {tag}: {type(err).__name__}: {err}")
            history.pop()
            continue
        calls.ok[tag] = time.perf_counter() - started
        history.append({"role": "assistant", "content": answer})
    async with http.post(f"{root}/rayrl/sessions/{info['session_id']}/finish", json={"reward": 1.0},
                         headers=ADMIN) as r:
        done = await r.json()
    calls.recorded += done["stats"]["turns"]
    for sample in done["samples"]:
        for s, t in ANSWER.findall(_generated_text(sample, tokenizer)):
            calls.found[f"s{s} t{t}"] = calls.found.get(f"s{s} t{t}", 0) + 1


async def poll_health(http: aiohttp.ClientSession, root: str, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        async with http.get(root + "/health") as r:
            await r.read()
        out.append(time.perf_counter() - started)
        await asyncio.sleep(0.02)


def serve_health_poller(root: str) -> None:
    """The /health poller process: polls until a line arrives on stdin, then prints the latencies (JSON)."""

    async def main() -> None:
        out: list[float] = []
        stop = asyncio.Event()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
            poller = asyncio.create_task(poll_health(http, root, stop, out))
            print("ready", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            stop.set()
            await poller
        print(json.dumps(out), flush=True)

    asyncio.run(main())


class HealthPoller:
    """``/health`` polled by a process of its own while a phase runs; ``stop()`` returns the latencies."""

    def __init__(self, root: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "health", root], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout.readline().strip() == "ready"  # type: ignore[union-attr]

    def stop(self) -> list[float]:
        out, _ = self.proc.communicate("stop\n", timeout=120)
        return json.loads(out.strip().splitlines()[-1])


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def big_body(root: str, mb: float) -> tuple[int, list[float]]:
    """One ``mb`` MB chat body from its own session; /health latencies while the gateway processes it."""
    text = "The quick brown fox jumps over the lazy dog. " * int(mb * 1e6 / 45)
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()
    health: list[float] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async with http.post(root + "/rayrl/sessions", json={}, headers=ADMIN) as r:
            token = (await r.json())["token"]
        poller = asyncio.create_task(poll_health(http, root, stop, health))
        await asyncio.sleep(0.2)
        health.clear()
        async with http.post(root + "/v1/chat/completions", data=body,
                             headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"}) as r:
            status = r.status
            await r.read()
        stop.set()
        await poller
    return status, health


async def run(args: argparse.Namespace) -> None:
    from measure import machine as machine_info
    from transformers import AutoTokenizer

    from rayrl.models import build_tiny_model

    info = machine_info()
    machine = f"{info['cpu']}, {info['cores']} cores"
    started_at = time.strftime("%Y-%m-%d %H:%M:%S %z")
    load_start = os.getloadavg()
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="soak-model-")))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    engine = subprocess.Popen([sys.executable, __file__, "engine", str(model_dir)], stdout=subprocess.PIPE, text=True,
                              env=env)
    gateway = None
    try:
        _, engine_url, timings_url = engine.stdout.readline().split()  # type: ignore[union-attr]
        gateway, root, _ = start_gateway(model_dir, engine_url, env)
        calls = Calls()
        alone = Calls()  # warm-up, then the added latency of calls made one at a time (session by session)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            for i in range(10**6, 10**6 + 30):
                await session(http, root, i, args.turns, alone, tokenizer)
        await asyncio.sleep(0.5)
        fds_before = fds(gateway.pid)
        fds_peak = fds_before
        timeout = aiohttp.ClientTimeout(total=600)
        poller = HealthPoller(root, env)
        started = time.perf_counter()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
            work = asyncio.gather(*(session(http, root, i, args.turns, calls, tokenizer) for i in range(args.sessions)))
            while not work.done():
                fds_peak = max(fds_peak, fds(gateway.pid))
                await asyncio.sleep(0.1)
            await work
        soak_s = time.perf_counter() - started
        health = poller.stop()
        big_status, big_health = await big_body(root, args.big_body_mb) if args.big_body_mb > 0 else (0, [])
        settle = time.perf_counter()
        while fds(gateway.pid) > fds_before and time.perf_counter() - settle < 30:
            await asyncio.sleep(0.25)
        fds_after, settle_s = fds(gateway.pid), time.perf_counter() - settle
        async with aiohttp.ClientSession() as http:
            async with http.get(timings_url + "/soak_timings") as r:
                engine_times = await r.json()
        rss = peak_rss_mb(gateway.pid)
    finally:
        for proc in (gateway, engine):
            if proc is not None:
                proc.terminate()
                proc.wait(30)

    load_end = os.getloadavg()
    answered = set(calls.ok)
    lost = sorted(tag for tag in answered if calls.found.get(tag, 0) == 0)
    duplicated = sorted(tag for tag, n in calls.found.items() if n > 1 or tag not in answered)
    added = [calls.ok[tag] - engine_times[tag] for tag in answered if tag in engine_times]
    one_at_a_time = [alone.ok[tag] - engine_times[tag] for tag in alone.ok if tag in engine_times]
    print(f"{started_at}; {machine}; load average {' / '.join(f'{x:.2f}' for x in load_start)} at start, "
          f"{' / '.join(f'{x:.2f}' for x in load_end)} at end (1/5/15 min)")
    print(f"sessions {args.sessions} x {args.turns} turns, all at once ({', '.join(APIS)}; streaming and not), "
          f"{soak_s:.1f} s")
    print(f"turns sent {calls.sent}, answered 200 {len(answered)}, failed {len(calls.failed)}, "
          f"recorded {calls.recorded}, lost {len(lost)}, duplicated {len(duplicated)}")
    print(f"latency added by the gateway: p50 {pct(added, 0.5) * 1e3:.1f} ms, p99 {pct(added, 0.99) * 1e3:.1f} ms "
          f"(end-to-end p50 {pct(list(calls.ok.values()), 0.5) * 1e3:.1f} ms, at {args.sessions} sessions at once)")
    print(f"latency added by the gateway, one call at a time: p50 {pct(one_at_a_time, 0.5) * 1e3:.1f} ms, "
          f"p99 {pct(one_at_a_time, 0.99) * 1e3:.1f} ms ({len(one_at_a_time)} calls before the soak)")
    print(f"/health during the soak: p50 {pct(health, 0.5) * 1e3:.1f} ms, p99 {pct(health, 0.99) * 1e3:.1f} ms "
          f"({len(health)} polls)")
    if args.big_body_mb > 0:
        print(f"/health while a {args.big_body_mb:g} MB body is processed (answered {big_status}): "
              f"p50 {pct(big_health, 0.5) * 1e3:.1f} ms, p99 {pct(big_health, 0.99) * 1e3:.1f} ms, "
              f"max {max(big_health, default=float('nan')) * 1e3:.1f} ms ({len(big_health)} polls)")
    print(f"gateway peak RSS {rss:.0f} MB")
    print(f"gateway open fds: {fds_before} before the sessions, {fds_peak} at the peak, {fds_after} after every "
          f"session finished (growth {fds_after - fds_before}; settled in {settle_s:.1f} s)")
    for line in (calls.failed + [f"lost {t}" for t in lost] + [f"duplicated {t}" for t in duplicated])[:10]:
        print("  ", line)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "engine":
        serve_engine(sys.argv[2])
        return
    if len(sys.argv) == 3 and sys.argv[1] == "health":
        serve_health_poller(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=3, help="calls per session")
    ap.add_argument("--big-body-mb", type=float, default=20.0, help="0: skip the big-body phase")
    args = ap.parse_args()
    if args.sessions < 1 or args.turns < 1:
        ap.error("--sessions and --turns must be at least 1")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
