"""Where the gateway's time goes: its hot path under py-spy or cProfile, with the overhead bench's stub
and load.

    python bench/gateway_profile.py [--sampler py-spy|cprofile] [--native] [--clients 64] [--seconds 10] [--top 30]

bench/gateway_overhead.py says how much the gateway adds; this says where. The stub engine is the one
gateway_overhead.py uses (instant fixed answers, streaming too), in its own process; the load (Chat
Completions at ``--clients`` concurrent clients, one gateway session each) comes from a second process;
the gateway runs in this process, so the profile holds the gateway's work and nothing else.

``--sampler py-spy`` (the default; the py-spy tool must be on PATH or beside this Python) samples this
process 1,000 times a second from outside without slowing it, and prints, for the thread that runs the
gateway's event loop, the share of samples waiting in the selector (idle), then of the busy samples the share
in which each function was running (self) and was on the stack (total), and the self shares grouped by
where the running code lives (a package, a standard-library module, rayrl's module, C, a shared library).
``--native`` adds the C frames (libc's system calls, CPython's and the extensions' C functions: llhttp,
orjson, numpy); py-spy then pauses the process for each sample, which slows it several times, so read
its shares, not its rate.
``--sampler cprofile`` counts every call (slowing Python code several times, most for small
calls) and prints pstats' tottime and cumtime lists; the profile is saved for ``python -m pstats``.
Either way these are shares of the time, not latencies: the added latency is gateway_overhead.py's to
measure.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_overhead import MESSAGES, REPO, STUB, free_port, spawn, wait_up  # noqa: E402

from rayrl.gateway import event_loop  # noqa: E402

LOAD = """
import asyncio, json, sys, time, aiohttp
url, tokens, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
body = json.dumps({"model": "stub", "messages": %r, "max_tokens": 16, "temperature": 1.0}).encode()
async def main():
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def client(tok, stop):
            nonlocal done
            while time.perf_counter() < stop:
                async with s.post(url, data=body, headers={"Authorization": "Bearer " + tok,
                                                           "Content-Type": "application/json"}) as r:
                    await r.read()
                    assert r.status == 200, r.status
                done += 1
        await asyncio.gather(*(client(t, 0) for t in tokens))
        print("ready", flush=True)
        sys.stdin.readline()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(t, t0 + seconds) for t in tokens))
        print(json.dumps({"requests": done, "seconds": time.perf_counter() - t0}), flush=True)
asyncio.run(main())
""" % (MESSAGES,)


async def profile(args: argparse.Namespace) -> tuple[pstats.Stats, dict]:
    from transformers import AutoTokenizer

    from rayrl.config import GatewayConfig, TrajectoryConfig
    from rayrl.engines.router import Router
    from rayrl.gateway.app import Gateway, settle_heap
    from rayrl.models import provision_smollm2

    tokenizer_dir = str(provision_smollm2())
    stub_port = free_port()
    stub = spawn(STUB, str(stub_port))
    load = None
    try:
        stub_url = f"http://127.0.0.1:{stub_port}"
        await wait_up(stub_url + "/health")
        router = Router([stub_url])
        gateway = Gateway(GatewayConfig(tool_parser="hermes"), TrajectoryConfig(),
                          AutoTokenizer.from_pretrained(tokenizer_dir), router, model_name="stub",
                          context_length=4096, admin_token="admin")
        base = await gateway.start(host="127.0.0.1", port=0)
        settle_heap()  # as the gateway's hosts do: else the profile holds collections they never make
        tokens = [gateway.open_session().token for _ in range(args.clients)]
        load = subprocess.Popen([sys.executable, "-c", LOAD, base + "/chat/completions", json.dumps(tokens),
                                 str(args.seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        loop = asyncio.get_running_loop()
        assert (await loop.run_in_executor(None, load.stdout.readline)).strip() == "ready"  # warmed up
        timer = (time.thread_time,) if args.cpu_clock else ()  # CPU time: a send that lets the engine run first
        profiler = cProfile.Profile(*timer) if args.sampler == "cprofile" else None
        if profiler is not None:
            profiler.enable()
        else:
            mode = ["--native"] if args.native else ["--nonblocking"]  # py-spy reads C stacks only while paused
            sampler = subprocess.Popen([py_spy(), "record", "--pid", str(os.getpid()), "--rate", "1000",
                                        "--duration", str(int(args.seconds)), "--format", "raw", *mode,
                                        "--output", str(args.out)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        load.stdin.write("go\n")
        load.stdin.flush()
        result = json.loads(await loop.run_in_executor(None, load.stdout.readline))
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        result["user_s"] = cpu_after.ru_utime - cpu_before.ru_utime
        result["system_s"] = cpu_after.ru_stime - cpu_before.ru_stime
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(args.out))
        else:
            await loop.run_in_executor(None, sampler.wait)
        await gateway.stop()
        await router.close()
    finally:
        for proc in (load, stub):
            if proc is not None:
                proc.kill()
                proc.wait()
    return result


def py_spy() -> str:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else "py-spy"


def _group(frame: str) -> str:
    """Where a frame's code lives: a site package, a standard-library module, rayrl's module, CPython's or an
    extension's C source, a shared library (``libc.so.6``)."""
    if " (" not in frame:
        return frame
    where = frame.rsplit(" (", 1)[1].rstrip(")").rsplit(":", 1)[0]
    if "site-packages/" in where:
        return where.split("site-packages/", 1)[1].split("/", 1)[0]
    if "rayrl/" in where:
        return "rayrl/" + where.split("rayrl/", 1)[1]
    if "/lib/python3" in where:
        where = where.split("/lib/python3", 1)[1].split("/", 1)[-1]
    if "/" in where:
        return where.split("/", 1)[0]  # a package (py-spy --native names files from their package)
    if where.endswith((".c", ".h")):
        return "C (CPython, extensions)"
    return where


def _is_loop_thread(frames: list[str]) -> bool:
    """A stack of this process's main thread, which runs the gateway's event loop (the front door's thread
    and the executor threads are left out)."""
    return any(f.startswith("main (") and "gateway_profile.py" in f for f in frames)


def summarize_raw(path: Path, top: int) -> str:
    """From py-spy's raw (collapsed) stacks of the event loop's thread: the share of samples waiting in the
    selector (idle), then, of the busy samples, self and total shares per function and self shares per
    :func:`_group`."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    groups: dict[str, int] = {}
    samples = idle = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        raw = stack.split(";")
        if not _is_loop_thread(raw):
            continue
        n = int(count)
        samples += n
        frames = [f.split(" (", 1)[0] + " (" + f.split(" (", 1)[1].rsplit(":", 1)[0].rsplit("/", 1)[-1] + ")"
                  if " (" in f else f for f in raw]
        if any(f.startswith("EpollSelector.select (") for f in frames) and not any(
                f.startswith(("Handle._run (", "_run_once_handle")) for f in frames):
            idle += n  # the loop waiting for sockets
            continue
        if frames[-1].startswith(("Runner.run (", "BaseEventLoop.run_until_complete (", "run (")):
            idle += n  # uvloop: its C loop (waiting, or its own work between callbacks) has no Python frame
            continue
        own[frames[-1]] = own.get(frames[-1], 0) + n
        leaf = _group(raw[-1])
        groups[leaf] = groups.get(leaf, 0) + n
        for name in set(frames):
            total[name] = total.get(name, 0) + n
    busy = max(samples - idle, 1)
    lines = [f"{samples} samples of the event loop's thread, {100 * idle / max(samples, 1):.1f}% waiting in the "
             f"selector; shares below are of the {samples - idle} busy ones"]
    for title, table in (("self (running in the function itself)", own), ("total (on the stack)", total),
                         ("self, by where the code lives", groups)):
        lines.append(f"\n{title}:")
        for name, n in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {100 * n / busy:5.1f}%  {name}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sampler", choices=["py-spy", "cprofile"], default="py-spy")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--native", action="store_true", help="py-spy: C frames too (the process paused per sample)")
    ap.add_argument("--cpu-clock", action="store_true",
                    help="cprofile: time functions by this thread's CPU time, not the wall clock")
    ap.add_argument("--out", type=Path, default=None, help="the profile (default runs/bench/gateway.<sampler>)")
    args = ap.parse_args()
    args.out = args.out or REPO / "runs" / "bench" / f"gateway.{args.sampler}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    load_start = os.getloadavg()
    result = event_loop.run(profile(args))  # the loop the gateway's hosts run it on
    rate = result["requests"] / result["seconds"]
    print(f"{started}; load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
          f"{result['requests']} requests in {result['seconds']:.1f} s at {args.clients} clients "
          f"({rate:.0f}/s under {args.sampler}); "
          f"gateway CPU per request {1e3 * result['user_s'] / result['requests']:.3f} "
          f"ms user + {1e3 * result['system_s'] / result['requests']:.3f} ms system; profile: {args.out}")
    if args.sampler == "py-spy":
        print(summarize_raw(args.out, args.top))
        return
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(str(args.out), stream=out).strip_dirs().sort_stats(key).print_stats(args.top)
        print(out.getvalue())


if __name__ == "__main__":
    main()
