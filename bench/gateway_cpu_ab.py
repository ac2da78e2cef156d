"""The gateway's CPU per call, this checkout against another, in alternation: a figure the machine's load
barely moves.

    python bench/gateway_cpu_ab.py --baseline DIR [--requests 300] [--rounds 9]

Where bench/gateway_overhead.py measures latency (which a busy machine stretches), this measures only what
each gateway process spends per call: the stub engine of gateway_overhead.py in one process, this
checkout's gateway and the gateway of ``--baseline`` (a ``git archive`` of main, say) each in a process of
its own against that one stub, and in this process one client sending the overhead bench's Chat Completions
call sequentially over one keep-alive connection. Each round runs a block of ``--requests`` calls on each
gateway, the order alternating from round to round; a block's figure is the CPU time of all the gateway
process's threads (Linux schedstat, in ns) over the block, divided by its calls. Printed: per side the
median [IQR] (min-max) over the rounds, and the per-round difference and ratio. Meant to run at the lowest
priority beside other work (``nice -n 19 chrt --idle 0``): a preempted process is not charged while it
waits, though cold caches after a preemption still cost a little.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_calls import ONE_WRITE_STUB  # noqa: E402
from gateway_overhead import (  # noqa: E402
    CHAT_CALL,
    OUTPUT_IDS,
    RAYRL,
    REPO,
    STUB,
    WARMUP,
    Target,
    _gateway_target,
    free_port,
    one,
    spawn,
    stop_all,
    wait_up,
)
from measure import Spread, paired_ratio  # noqa: E402

PACED_TOKENS = 128
PACED_GAP_S = 0.0005
# --stub paced: a generation as an engine streams it, one chunk per token with time between them, so each
# chunk arrives in a read of its own (a long answer to an agent that does not stream)
_PACED_IDS = [28 + i % 1000 for i in range(PACED_TOKENS)]
PACED_STUB = (STUB.replace(f"IDS = {OUTPUT_IDS!r}", f"IDS = {_PACED_IDS!r}")
              .replace("import json, sys, time", "import asyncio, json, sys, time")
              .replace("        await resp.write(chunk)\n",
                       f"        await resp.write(chunk)\n        await asyncio.sleep({PACED_GAP_S})\n"))
assert PACED_STUB.count("asyncio.sleep") == 1, "the stub's stream loop moved: update gateway_cpu_ab.py"
STUBS = {"bench": STUB, "one-write": ONE_WRITE_STUB, "paced": PACED_STUB}


def process_cpu_s(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far (schedstat's first field, ns)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


async def block(session: aiohttp.ClientSession, target: Target, pid: int, n: int) -> float:
    """CPU ms per call of ``pid`` over ``n`` sequential calls."""
    for _ in range(WARMUP):
        await one(session, target, 0)
    cpu0 = process_cpu_s(pid)
    for _ in range(n):
        await one(session, target, 0)
    return (process_cpu_s(pid) - cpu0) / n * 1e3


async def run(args: argparse.Namespace) -> None:
    from rayrl.models import provision_smollm2

    tokenizer_dir = str(provision_smollm2())
    ports = {k: free_port() for k in ("stub", "branch", "base")}
    stub_url = f"http://127.0.0.1:{ports['stub']}"
    procs = [spawn(STUBS[args.stub], str(ports["stub"]))]
    try:
        await wait_up(stub_url + "/health")
        procs.append(spawn(RAYRL, str(ports["branch"]), stub_url, tokenizer_dir))
        procs.append(spawn(RAYRL, str(ports["base"]), stub_url, tokenizer_dir, tree=args.baseline))
        sides = {}
        for name, proc in (("branch", procs[1]), ("base", procs[2])):
            root = f"http://127.0.0.1:{ports[name]}"
            await wait_up(root + "/health")
            sides[name] = (await _gateway_target(name, root, 1, CHAT_CALL), proc.pid)
        figures: dict[str, list[float]] = {name: [] for name in sides}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for name in order:
                    target, pid = sides[name]
                    figures[name].append(await block(session, target, pid, args.requests))
                print(f"round {r + 1}: " + "  ".join(f"{n} {figures[n][-1]:.4f}" for n in sides), flush=True)
    finally:
        stop_all(procs)
    branch, base = Spread(tuple(figures["branch"])), Spread(tuple(figures["base"]))
    diff = Spread(tuple(a - b for a, b in zip(branch.samples, base.samples)))
    print(f"gateway CPU ms per call, {args.rounds} rounds of {args.requests} calls, stub: {args.stub}:")
    print(f"  branch ({REPO}): {branch.fmt(4)}")
    print(f"  base ({args.baseline}): {base.fmt(4)}")
    print(f"  branch - base: {diff.fmt(4)}")
    print(f"  branch / base: {paired_ratio(branch, base).fmt(4)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="the other checkout's root")
    ap.add_argument("--requests", type=int, default=300, help="calls per block")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--stub", choices=sorted(STUBS), default="bench",
                    help="one-write: the stub sends its stream in one write (gateway_calls.py says why); "
                         f"paced: {PACED_TOKENS} tokens, one chunk every {PACED_GAP_S * 1e3:g} ms")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
