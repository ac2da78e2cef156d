"""Session capacity: N agent sessions open at once on one gateway shard (or spread over S).

    python bench/session_capacity.py [--sessions 1000 3000 10000] [--shards 1 4] [--turns 5] [--think-s 30]
                                     [--earlier RECORD]

Processes on loopback, each a real HTTP server or client:
- the stub engine: tests/gateway/scripted_engine.py (a real HTTP server speaking SGLang's ``/generate``
  that answers at once with token ids and log-probs), scripted to answer each turn but the last with a
  ``bash`` tool call and the last with text;
- S gateway shards: ``python -m rayrl.gateway serve --engine-url`` (the same ``Gateway`` class the
  GatewayShard actor hosts); session i lives on shard i mod S, as ``trajectory.num_shards``
  spreads sessions (actors/gateway_shard.py: new sessions round-robin, calls routed by id);
- ``--loadgens`` load-generator processes, each holding its share of the sessions, every session on a
  keep-alive connection of its own, as each agent holds its own HTTP client;
- a ``/health`` poller on its own connection (bench/gateway_soak.py's), every 20 ms, to shard 0.

A session is an agent episode: it is opened (``POST /rayrl/sessions``), then makes ``--turns`` Chat
Completions calls with two tools declared, replaying its history as real clients do. Between calls it
"runs the tool": it sleeps a think time drawn from a log-normal of mean ``--think-s`` (sigma 0.8: most
calls come quickly, a few tools run long; cut at 3x the mean), then sends the tool's output (a few
hundred characters) back. Sessions start at random times over the first ``--ramp-s`` seconds, so calls
arrive at a steady rate of about N / think-s per second and all N are open together for a while. After
its last turn the session is finished (``POST /rayrl/sessions/{id}/finish``) and checked: an episode is
lost when any of its calls failed, or its recorded turns are not the turns answered, or its samples'
trained tokens (loss mask) are not exactly the completion tokens its calls were answered with.

Reported per run: the manager's own time to record a turn into its tree (p50/p99/max: the gateway
times ``TrajectoryTree.record_turn`` for every turn, rayrl/gateway/durations.py, read from ``GET
/rayrl/stats``) and to fold a finished session into samples; ``/health`` p50/p99/max; each shard's RSS
before the sessions, at the most sessions open, and after; RSS growth per open session; open file
descriptors at the peak; each shard's CPU use; the calls per second; and the episodes lost. The load
generators report their own event-loop lag and CPU use: a load generator that lags cannot send on time,
so a figure measured under it would be its own limit, not the gateway's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from gateway_proc import start_gateway
from gateway_soak import HealthPoller, pct
from measure import Record, add_common_args

REPO = Path(__file__).resolve().parents[1]
TAG = re.compile(r"\[cap s(\d+) t(\d+)/(\d+)\]")
ADMIN = {"Authorization": "Bearer admin"}
SYSTEM = ("You are a software engineering agent working in a repository. Use the tools to inspect files and "
          "run commands; keep each command short; report what you found when you are done. " * 3).strip()
TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a shell command in the repository and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]
TOOL_OUTPUT = ("src/module.py:12: def handler(request):\nsrc/module.py:40:     return response\n"
               "tests/test_module.py:8: def test_handler():\n") * 4


# -- the engine process ------------------------------------------------------------------------------


def serve_engine(tokenizer_dir: str) -> None:
    """The stub engine: tests/gateway/scripted_engine.py's server and answers, leaner per call (the bench's
    thousands of calls share two cores with the gateway): the turn's tag is read from the prompt's last
    tokens only, a stream is one chunk holding the whole answer (what SGLang's last chunk holds), and a
    tool call ends at its stop string ``</tool_call>``, matched, as the gateway asks."""
    sys.path.insert(0, str(REPO))
    from aiohttp import web
    from transformers import AutoTokenizer

    from tests.gateway.scripted_engine import ScriptedEngine

    class LeanEngine(ScriptedEngine):
        async def _generate(self, request: web.Request) -> web.StreamResponse:
            body = await request.json()
            ids_in = body["input_ids"]
            found = TAG.findall(self.tokenizer.decode(ids_in[-400:]))
            s, t, n = found[-1] if found else ("?", "0", "0")
            if int(t) + 1 < int(n):
                stop = "</tool_call>"
                text = ('<tool_call>\n{"name": "bash", "arguments": {"command": "grep -rn handler src # s%s t%s"}}'
                        "\n" % (s, t)) + stop
                ids, finish = self.tokenizer(text, add_special_tokens=False)["input_ids"], {"type": "stop",
                                                                                            "matched": stop}
            else:
                text = f"The handler is in src/module.py (s{s} t{t})."
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos]
                finish = {"type": "stop", "matched": self.eos}
            chunk = self._chunk(ids, body.get("rid", "r"), len(ids_in), finish)
            if not body.get("stream"):
                return web.json_response(chunk)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp

    async def main() -> None:
        engine = LeanEngine(AutoTokenizer.from_pretrained(tokenizer_dir), lambda prompt: "")
        print(f"ready {await engine.start()}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# -- a load generator process ------------------------------------------------------------------------


class Outcome:
    def __init__(self) -> None:
        self.latencies: list[float] = []  # each call, end to end at the client
        self.calls = 0
        self.failed: list[str] = []  # one line per failed call
        self.lost: list[str] = []  # one line per lost episode
        self.done = 0
        self.tokens = 0  # tokens in the finished sessions' samples


def _think(rng: random.Random, mean_s: float) -> float:
    """A tool's time: log-normal (sigma 0.8) of mean ``mean_s``, cut at 3x the mean (a harness's tool
    timeout; without it the slowest of 10,000 sessions would run for minutes after the others)."""
    sigma = 0.8
    return min(3 * mean_s, rng.lognormvariate(math.log(mean_s) - sigma * sigma / 2, sigma))


async def post_json(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                    headers: dict[str, str]) -> dict[str, Any]:
    """POST ``body``; the answer's JSON, or RuntimeError naming a status other than 200."""
    async with http.post(url, json=body, headers=headers) as r:
        answer = await r.json()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {json.dumps(answer)[:200]}")
        return answer


async def episode(i: int, roots: list[str], cfg: dict[str, Any], out: Outcome, rng: random.Random) -> None:
    root = roots[i % len(roots)]
    turns = cfg["turns"]
    await asyncio.sleep(rng.uniform(0, cfg["ramp_s"]))
    timeout = aiohttp.ClientTimeout(total=cfg["call_timeout_s"])
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=timeout) as http:
        try:
            info = await post_json(http, root + "/rayrl/sessions", {"metadata": {"i": i}}, ADMIN)
        except Exception as err:
            out.lost.append(f"s{i}: open failed: {type(err).__name__}: {err}")
            return
        headers = {"Authorization": f"Bearer {info['token']}"}
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"[cap s{i} t0/{turns}] Find where the request handler is defined."}]
        answered, completion_tokens, ok = 0, 0, True
        for t in range(turns):
            out.calls += 1
            started = time.perf_counter()
            try:
                body = await post_json(http, root + "/v1/chat/completions",
                                       {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 64},
                                       headers)
            except Exception as err:
                out.failed.append(f"s{i} t{t}: {type(err).__name__}: {err}")
                ok = False
                break
            out.latencies.append(time.perf_counter() - started)
            answered += 1
            completion_tokens += body["usage"]["completion_tokens"]
            message = body["choices"][0]["message"]
            messages.append(message)
            if t + 1 < turns:
                calls = message.get("tool_calls") or []
                if not calls or f"s{i} t{t}" not in calls[0]["function"]["arguments"]:
                    out.failed.append(f"s{i} t{t}: expected a bash call for this turn, got {json.dumps(message)[:200]}")
                    ok = False
                    break
                await asyncio.sleep(_think(rng, cfg["think_s"]))
                messages.append({"role": "tool", "tool_call_id": calls[0]["id"],
                                 "content": TOOL_OUTPUT + f"[cap s{i} t{t + 1}/{turns}]"})
        try:
            done = await post_json(http, f"{root}/rayrl/sessions/{info['session_id']}/finish", {"reward": 1.0},
                                   ADMIN)
        except Exception as err:
            out.lost.append(f"s{i}: finish failed: {type(err).__name__}: {err}")
            return
        trained = sum(sum(s["loss_mask"]) for s in done["samples"])
        out.tokens += sum(len(s["tokens"]) for s in done["samples"])
        recorded = done["stats"]["turns"]
        if not ok or recorded != answered or trained != completion_tokens:
            out.lost.append(f"s{i}: {answered}/{turns} answered, {recorded} recorded, {trained} trained tokens "
                            f"for {completion_tokens} generated")
        out.done += 1


async def lag_probe(stop: asyncio.Event, lags: list[float], period_s: float = 0.05) -> None:
    """How late this process's event loop wakes (its own lag: a late loop sends late)."""
    while not stop.is_set():
        due = time.perf_counter() + period_s
        await asyncio.sleep(period_s)
        lags.append(max(0.0, time.perf_counter() - due))


def run_loadgen(cfg: dict[str, Any]) -> None:
    """One load generator: sessions ``cfg['first']``, ``first + step``, ... below ``cfg['sessions']``."""

    async def main() -> None:
        out, lags, stop = Outcome(), [], asyncio.Event()
        rng = random.Random(cfg["seed"] + cfg["first"])
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        probe = asyncio.create_task(lag_probe(stop, lags))
        await asyncio.gather(*(episode(i, cfg["roots"], cfg, out, rng)
                               for i in range(cfg["first"], cfg["sessions"], cfg["step"])))
        stop.set()
        await probe
        wall = time.perf_counter() - wall0
        # to a file: thousands of latencies are more than a pipe holds, and the bench reads its load
        # generators' pipes only once they have exited (a load generator blocked on a full pipe never does)
        result = {"latencies": out.latencies, "calls": out.calls, "failed": out.failed, "lost": out.lost,
                  "done": out.done, "tokens": out.tokens, "lag_p99_s": pct(lags, 0.99),
                  "lag_max_s": max(lags, default=0.0), "cpu_s": time.process_time() - cpu0, "wall_s": wall}
        Path(cfg["result"]).write_text(json.dumps(result))
        print("done", flush=True)

    asyncio.run(main())


# -- the driver --------------------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, float]:
    """RSS (MB), open descriptors and CPU seconds (user + system) of a process."""
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return {"rss_mb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "cpu_s": cpu}


def http_json(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
        return json.loads(r.read())


def one_run(args: argparse.Namespace, n: int, shards: int, model_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """N sessions over ``shards`` gateways; the figures of one row."""
    load_start = os.getloadavg()
    procs: list[subprocess.Popen] = []
    try:
        engine = subprocess.Popen([sys.executable, __file__, "engine", str(model_dir)], stdout=subprocess.PIPE,
                                  text=True, env=env)
        procs.append(engine)
        engine_url = engine.stdout.readline().split()[1]  # type: ignore[union-attr]
        gateways = [start_gateway(model_dir, engine_url, env) for _ in range(shards)]
        procs += [g.proc for g in gateways]
        roots = [g.root for g in gateways]
        time.sleep(1.0)
        before = [proc_status(g.proc.pid) for g in gateways]
        engine_cpu0 = proc_status(engine.pid)["cpu_s"]
        cfg = {"roots": roots, "sessions": n, "step": args.loadgens, "turns": args.turns, "think_s": args.think_s,
               "ramp_s": args.ramp_s, "seed": args.seed, "call_timeout_s": args.call_timeout_s}
        results_dir = Path(tempfile.mkdtemp(prefix="capacity-loadgens-"))
        result_files = [results_dir / f"loadgen-{k}.json" for k in range(args.loadgens)]
        loadgens = [subprocess.Popen([sys.executable, __file__, "load",
                                      json.dumps({**cfg, "first": k, "result": str(result_files[k])})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                    for k in range(args.loadgens)]
        procs += loadgens
        for lg in loadgens:
            assert lg.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        poller = HealthPoller(roots[0], env)
        started = time.perf_counter()
        for lg in loadgens:
            lg.stdin.write("go\n")  # type: ignore[union-attr]
            lg.stdin.flush()  # type: ignore[union-attr]
        peak_open, at_peak, fds_peak = 0, before, [b["fds"] for b in before]
        while any(lg.poll() is None for lg in loadgens):
            time.sleep(0.5)
            if time.perf_counter() - started > args.run_limit_s:
                raise RuntimeError(f"the run passed --run-limit-s {args.run_limit_s}")
            try:
                now = [proc_status(g.proc.pid) for g in gateways]
                open_now = sum(http_json(root + "/health")["open_sessions"] for root in roots)
            except (OSError, ValueError):
                continue
            fds_peak = [max(a, b["fds"]) for a, b in zip(fds_peak, now)]
            if open_now > peak_open:
                peak_open, at_peak = open_now, now
        wall = time.perf_counter() - started
        for lg in loadgens:
            lg.communicate(timeout=120)
            if lg.returncode != 0:
                raise RuntimeError(f"a load generator exited {lg.returncode}")
        results = [json.loads(f.read_text()) for f in result_files]
        shutil.rmtree(results_dir, ignore_errors=True)
        health = poller.stop()
        after = [proc_status(g.proc.pid) for g in gateways]
        engine_cpu = proc_status(engine.pid)["cpu_s"] - engine_cpu0
        stats = [http_json(root + "/rayrl/stats", ADMIN) for root in roots]
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    load_end = os.getloadavg()
    latencies = [x for r in results for x in r["latencies"]]
    record = [s["durations"]["record_turn"] for s in stats]
    finish = [s["durations"]["finish_session"] for s in stats]
    rss_growth = sum(p["rss_mb"] - b["rss_mb"] for p, b in zip(at_peak, before))
    row = {
        "sessions": n, "shards": shards, "peak_open": peak_open, "wall_s": wall,
        "calls": sum(r["calls"] for r in results), "calls_per_s": sum(r["calls"] for r in results) / wall,
        "record_p50_ms": max(r["p50_ms"] for r in record), "record_p99_ms": max(r["p99_ms"] for r in record),
        "record_max_ms": max(r["max_ms"] for r in record), "recorded": sum(r["count"] for r in record),
        "finish_p50_ms": max(r["p50_ms"] for r in finish), "finish_p99_ms": max(r["p99_ms"] for r in finish),
        "health_p50_ms": pct(health, 0.5) * 1e3, "health_p99_ms": pct(health, 0.99) * 1e3,
        "health_max_ms": max(health, default=float("nan")) * 1e3, "health_polls": len(health),
        "call_p50_ms": pct(latencies, 0.5) * 1e3, "call_p99_ms": pct(latencies, 0.99) * 1e3,
        "rss_before_mb": sum(b["rss_mb"] for b in before), "rss_peak_mb": sum(p["rss_mb"] for p in at_peak),
        "rss_after_mb": sum(a["rss_mb"] for a in after),
        "rss_per_session_kb": rss_growth * 1024 / peak_open if peak_open else float("nan"),
        "fds_peak": max(fds_peak), "tokens_per_session": sum(r["tokens"] for r in results) / max(1, n),
        "gateway_cpu_pct": max(100 * (a["cpu_s"] - b["cpu_s"]) / wall for a, b in zip(after, before)),
        "engine_cpu_pct": 100 * engine_cpu / wall,
        "loadgen_cpu_pct": max(100 * r["cpu_s"] / r["wall_s"] for r in results),
        "loadgen_lag_p99_ms": max(r["lag_p99_s"] for r in results) * 1e3,
        "loadgen_lag_max_ms": max(r["lag_max_s"] for r in results) * 1e3,
        "failed_calls": sum(len(r["failed"]) for r in results), "episodes_done": sum(r["done"] for r in results),
        "lost": sum(len(r["lost"]) for r in results) + (n - sum(r["done"] for r in results)
                                                        - sum(len(r["lost"]) for r in results)),
        "examples": [x for r in results for x in r["failed"] + r["lost"]][:5],
        "load_start": load_start, "load_end": load_end,
    }
    return row


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "engine":
        serve_engine(sys.argv[2])
        return
    if len(sys.argv) == 3 and sys.argv[1] == "load":
        run_loadgen(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1000, 3000, 10000])
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 4],
                    help="every N on one shard, then the largest N on each of these shard counts")
    ap.add_argument("--turns", type=int, default=5, help="calls per session (all but the last: a tool call)")
    ap.add_argument("--think-s", type=float, default=30.0, help="mean think (tool) time between a session's calls")
    ap.add_argument("--ramp-s", type=float, default=None, help="sessions start over this long (default: think-s)")
    ap.add_argument("--loadgens", type=int, default=2, help="load-generator processes")
    ap.add_argument("--call-timeout-s", type=float, default=300.0)
    ap.add_argument("--run-limit-s", type=float, default=1200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--earlier", type=Path, default=None,
                    help="the record of an earlier run of this bench with the same settings: its rows are shown "
                         "beside this run's and not run again (e.g. 1 and 4 shards there, --shards 2 here)")
    add_common_args(ap)
    args = ap.parse_args()
    if args.ramp_s is None:
        args.ramp_s = args.think_s
    if args.quick:
        args.sessions, args.shards, args.turns, args.think_s, args.ramp_s = [100], [1, 2], 4, 1.0, 1.0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    from rayrl.models import build_tiny_model

    rec = Record("session_capacity", "Concurrent sessions on one gateway shard", quick=args.quick,
                 record_dir=args.record_dir)
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="capacity-model-")))
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'bench'}"}
    settings = (
        f"{args.turns} calls per session (a bash tool call each but the last), think time log-normal of mean "
        f"{args.think_s:g} s (cut at 3x), sessions starting over {args.ramp_s:g} s, {args.loadgens} load generators; "
        "record = the manager's own time to record a turn in its tree, finish = to fold a session into samples "
        "(the worst shard's percentiles); health polled every 20 ms on shard 0")
    earlier = json.loads(args.earlier.read_text()) if args.earlier else None
    if earlier is not None and earlier["tables"][0]["title"] != settings:
        raise SystemExit(f"--earlier {args.earlier}: its run had other settings ({earlier['command']})")
    kept = earlier["figures"]["rows"] if earlier is not None else []
    rows = list(kept)
    plan = [(n, 1) for n in args.sessions] + [(max(args.sessions), s) for s in args.shards if s != 1]
    for n, shards in plan:
        if any((r["sessions"], r["shards"]) == (n, shards) for r in kept):
            continue
        print(f"-- {n} sessions on {shards} shard(s)", flush=True)
        row = one_run(args, n, shards, model_dir, env)
        print(json.dumps(row), flush=True)
        rows.append(row)
    rows.sort(key=lambda r: (r["sessions"], r["shards"]))
    load = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    if earlier is not None:  # said first: which rows this run measured and which it shows from the earlier one
        ran = ", ".join(f"{r['sessions']} on {r['shards']}" for r in rows if r not in kept)
        shown = ", ".join(f"{r['sessions']} on {r['shards']}" for r in kept)
        rec.note(f"sessions on shards measured in this run: {ran}; shown from the earlier run with the same "
                 f"settings (`{earlier['command']}`, {earlier['started']}, commit {earlier.get('commit')}, load "
                 f"{load(earlier['load_start'])} at start, {load(earlier['load_end'])} at end): {shown}")
    rec.table(
        settings,
        ["sessions", "shards", "most open", "calls/s", "record p50 / p99 / max ms", "finish p50 / p99 ms",
         "/health p50 / p99 / max ms", "call p50 / p99 ms (client)", "lost", "load start / end"],
        [[r["sessions"], r["shards"], r["peak_open"], f"{r['calls_per_s']:.0f}",
          f"{r['record_p50_ms']:.3f} / {r['record_p99_ms']:.3f} / {r['record_max_ms']:.1f}",
          f"{r['finish_p50_ms']:.2f} / {r['finish_p99_ms']:.2f}",
          f"{r['health_p50_ms']:.1f} / {r['health_p99_ms']:.1f} / {r['health_max_ms']:.0f}",
          f"{r['call_p50_ms']:.1f} / {r['call_p99_ms']:.0f}", r["lost"],
          f"{load(r['load_start'])} ; {load(r['load_end'])}"] for r in rows])
    rec.table(
        "memory, descriptors and CPU (RSS summed over the shards; per session = growth from before the sessions "
        "to the most open, over the sessions open then; CPU % of one core over the run)",
        ["sessions", "shards", "RSS before / peak / after MB", "per session KB", "tokens per session",
         "fds at peak", "gateway CPU %", "engine CPU %", "load gen CPU % / lag p99 ms / max ms"],
        [[r["sessions"], r["shards"], f"{r['rss_before_mb']:.0f} / {r['rss_peak_mb']:.0f} / {r['rss_after_mb']:.0f}",
          f"{r['rss_per_session_kb']:.0f}", f"{r['tokens_per_session']:.0f}", r["fds_peak"],
          f"{r['gateway_cpu_pct']:.0f}", f"{r['engine_cpu_pct']:.0f}",
          f"{r['loadgen_cpu_pct']:.0f} / {r['loadgen_lag_p99_ms']:.0f} / {r['loadgen_lag_max_ms']:.0f}"]
         for r in rows])
    rec.note(f"file descriptor limit (RLIMIT_NOFILE) of the bench's processes: {soft} soft, {hard} hard")
    for r in rows:
        for line in r["examples"]:
            rec.note(f"{r['sessions']} sessions, {r['shards']} shard(s): {line}")
    rec.figure("rows", rows)
    rec.save()


if __name__ == "__main__":
    main()
