"""The CPU engine against llama.cpp on the same SmolLM2-135M GGUF and thread count, side by side in one run.

A CPU user who wants to serve a small model would pick llama.cpp, so that is the engine to beat. Both
sides get the same token ids (the prompts are tokenized once, here), generate greedily for a fixed
number of tokens (no early stop) and use the same number of threads. Each engine lives in its own
worker process (two OpenMP runtimes in one process would fight over the cores) and is idle while the
other one runs; bench/measure.py alternates them round by round.

- ours: rayrl/engines/cpu/engine.py in process, as bench/engine_throughput.py starts it, with
  ``engine.dtype: auto`` resolved as rayrl/machine.py compute_dtype does (float32 on a CPU without native
  bf16) and ``engine.weight_format`` as configured (``--weight-format``, default auto: fp16-packed on
  x86). Its weights are the GGUF dequantised to float32 (rayrl/models.py converts it), then packed.
  Its prefix cache is flushed before every run and every run gets fresh prompts, so no prefill is
  skipped.
- llama.cpp: llama-cpp-python (the ``bench`` extra, built from source) running the GGUF's own
  quantised weights (Q4_1 for the linear layers, Q8_0 for the tied embedding/output matrix).
  llama-cpp-python's server takes one request at a time (``llama_cpp/server/app.py`` holds a lock
  around the model; it has no parallel slots), so concurrent requests go through its batched C API
  (``llama_batch`` + ``llama_decode``) instead: every running sequence gets one token per decode
  call, and prompts are packed into batches of ``n_batch`` tokens. That is continuous batching as
  llama.cpp's own C++ server does it with ``--parallel`` slots (all requests arrive together here).
  Defaults otherwise: n_batch 2048, n_ubatch 512, f16 KV cache, flash attention auto.

Measured, each engine's median and spread over alternating rounds:

- batch-1 decode tokens/s (after the first token; short prompt);
- throughput at 8 and 32 concurrent requests: generated tokens/s including prefill (prompts of
  64-128 tokens, so the rounds stay short enough to repeat on 2 cores);
- time to first token for one 300-token prompt.

Then a roofline: the model's FLOPs per token (2 x the weights of every matmul, plus attention over
the context) against a float32 matmul peak measured with torch on the same threads, so each engine's
share of the compute limit is visible. Batch-1 decode is bound by memory, not FLOPs: the weight bytes
read per token against a measured copy bandwidth are printed beside it. Where the time goes: both
sides' prefill and decode split per row, and a torch profile of ours (one run per row, after the
alternating rounds) by kind of work, with the time outside any op (Python, dispatch, thread waits).

Goals for ours (issue 26): at least 1.5x llama.cpp at 8 and 32 concurrent requests, at least 0.4x at
batch 1.

    python bench/engine_vs_llamacpp.py [--threads 0] [--new-tokens 64] [--weight-format auto] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from engine_profile import op_kind, report_profile
from measure import Record, Spread, add_common_args, alternate, paired_ratio

HERE = Path(__file__).resolve()
SIDES = ("ours", "llama.cpp")
HEAD = 4  # generated tokens per sequence compared between the engines (a check that both decode right)


# ---------------------------------------------------------------------------------------------- workers


class OursWorker:
    """rayrl's CPUEngine in this process."""

    def __init__(self, threads: int, weight_format: str, dtype: str) -> None:
        from rayrl.engines.cpu.engine import CPUEngine
        from rayrl.machine import compute_dtype, cpu_has_native_bf16
        from rayrl.models import resolve_model_path

        self.dtype = compute_dtype(dtype, cuda=False, native_bf16=cpu_has_native_bf16())
        self.engine = CPUEngine(resolve_model_path("smollm2-135m-instruct"), dtype=self.dtype,
                                max_batch_size=32, num_threads=threads, weight_format=weight_format).start()

    def info(self) -> dict[str, Any]:
        import torch

        stats = self.engine.stats()
        params = sum(p.numel() * p.element_size() for p in self.engine.model.parameters())
        # what a decode step reads: the packed copies where there are some (norms and one embedding row
        # per token are too small to count), else the model's own weights
        read = stats["packed_weight_bytes"] or params
        return {"dtype": self.dtype, "threads": torch.get_num_threads(), "weight_bytes": read,
                "weight_format": stats["weight_format"], "decode_path": stats["decode_path"],
                "decode_attention": stats["decode_attention"],
                "load_pack_s": stats["weight_load_pack_seconds"], "config": self.engine.model.config.to_dict()}

    def run(self, prompts: Sequence[list[int]], new_tokens: int) -> dict[str, Any]:
        self.engine.flush_cache()  # no prompt may be served from an earlier run's KV
        params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
        start = time.perf_counter()
        handles = [self.engine.submit(p, params, return_logprob=False) for p in prompts]
        outputs = [h.result(900).output_ids for h in handles]
        end = time.perf_counter()
        if any(len(o) != new_tokens for o in outputs):
            raise RuntimeError("the engine stopped early")
        return {"wall": end - start, "first": [h.first_token_at - start for h in handles],
                "head": [list(o[:HEAD]) for o in outputs]}

    def profile(self, prompts: Sequence[list[int]], new_tokens: int) -> dict[str, Any]:
        """One run under torch's profiler: self time of every op on the engine thread, by kind, and the
        engine's own prefill/decode seconds."""
        from torch.profiler import ProfilerActivity, profile

        before = self.engine.stats()
        holder: list[Any] = []  # torch's profiler records the thread it starts on: the engine's loop thread
        self.engine._call_in_loop(lambda: holder.append(profile(activities=[ProfilerActivity.CPU]).__enter__()))
        r = self.run(prompts, new_tokens)
        self.engine._call_in_loop(lambda: holder[0].__exit__(None, None, None))
        prof = holder[0]
        after = self.engine.stats()
        kinds: dict[str, float] = {}
        for op in prof.key_averages():
            kinds[op_kind(op.key)] = kinds.get(op_kind(op.key), 0.0) + op.self_cpu_time_total / 1e6
        steps = after["decode_steps"] - before["decode_steps"]
        return {"wall": r["wall"], "kinds": kinds, "steps": steps,
                "prefill_s": after["prefill_seconds"] - before["prefill_seconds"],
                "decode_s": after["decode_seconds"] - before["decode_seconds"]}


    def roofline(self) -> dict[str, float]:
        """A float32 matmul peak and a copy bandwidth, with torch on this worker's threads."""
        import torch

        best = 0.0
        for n in (1024, 2048):
            a, b = torch.randn(n, n), torch.randn(n, n)
            torch.mm(a, b)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                torch.mm(a, b)
                times.append(time.perf_counter() - t0)
            best = max(best, 2 * n**3 / sorted(times)[len(times) // 2])
        src, dst = torch.ones(64 << 20), torch.empty(64 << 20)  # 256 MiB each, far beyond the caches
        dst.copy_(src)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return {"matmul_flops": best, "copy_bytes_per_s": 2 * src.numel() * 4 / sorted(times)[2]}


class LlamaWorker:
    """llama.cpp through llama-cpp-python's C API: one context, ``n_seq_max`` sequences, greedy."""

    def __init__(self, threads: int, n_ctx: int, n_seq: int) -> None:
        import ctypes

        import llama_cpp as ll
        import numpy as np

        from rayrl.models import _gguf_location

        self.ll, self.np = ll, np
        self._quiet = ll.llama_log_callback(lambda level, text, data: None)  # kept alive: C holds it
        ll.llama_log_set(self._quiet, ctypes.c_void_p())
        ll.llama_backend_init()
        self.path = _gguf_location()
        self.model = ll.llama_model_load_from_file(str(self.path).encode(), ll.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max, cp.n_threads, cp.n_threads_batch = n_ctx, n_seq, threads, threads
        cp.kv_unified = True  # one KV pool shared by all sequences, as llama-server's slots use it
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch, self.threads = int(cp.n_batch), threads
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)

    def info(self) -> dict[str, Any]:
        return {"threads": self.threads, "gguf": self.path.name, "n_batch": self.n_batch,
                "file_bytes": self.path.stat().st_size, "version": self.ll.__version__}

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> Any:
        """One llama_decode of (seq, pos, token, wants_logits) entries; the argmax of each output row."""
        b = self.batch
        for i, (seq, pos, tok, out) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        outputs = sum(1 for e in entries if e[3])
        logits = self.np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape=(outputs, self.n_vocab))
        return logits.argmax(axis=1)

    def run(self, prompts: Sequence[list[int]], new_tokens: int) -> dict[str, Any]:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        first: list[float] = [0.0] * len(prompts)
        last = [0] * len(prompts)
        head: list[list[int]] = [[] for _ in prompts]
        pending = [(s, pos, tok, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        for lo in range(0, len(pending), self.n_batch):  # prompts packed n_batch tokens per call
            chunk = pending[lo : lo + self.n_batch]
            picks = self._decode(chunk)
            now = time.perf_counter() - start
            for (seq, _, _, _), tok in zip([e for e in chunk if e[3]], picks):
                first[seq], last[seq] = now, int(tok)
                head[seq].append(int(tok))
        for step in range(1, new_tokens):  # every sequence one token per call
            picks = self._decode([(s, len(p) + step - 1, last[s], True) for s, p in enumerate(prompts)])
            last = [int(t) for t in picks]
            if step < HEAD:
                for seq, tok in enumerate(last):
                    head[seq].append(tok)
        return {"wall": time.perf_counter() - start, "first": first, "head": head}


def worker_main(kind: str, threads: int, n_ctx: int, n_seq: int, weight_format: str, dtype: str) -> None:
    """JSON lines on stdin -> JSON lines on the original stdout (fd 1 is pointed at stderr, so what
    native libraries print cannot corrupt the replies)."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    worker = OursWorker(threads, weight_format, dtype) if kind == "ours" else LlamaWorker(threads, n_ctx, n_seq)
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        out = getattr(worker, cmd["op"])(*cmd.get("args", []))
        reply.write(json.dumps(out) + "\n")
        reply.flush()


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self, kind: str, args: argparse.Namespace, n_ctx: int, n_seq: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), "--worker", kind, "--threads", str(args.threads),
             "--n-ctx", str(n_ctx), "--n-seq", str(n_seq), "--weight-format", args.weight_format,
             "--dtype", args.dtype],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if not json.loads(self._line()).get("ready"):
            raise RuntimeError(f"{kind} worker did not start")

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return line

    def call(self, op: str, *args: Any) -> Any:
        self.proc.stdin.write(json.dumps({"op": op, "args": list(args)}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
            except (RuntimeError, BrokenPipeError, json.JSONDecodeError):
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------------------- parent


def flops_per_token(config: dict[str, Any], context: float) -> float:
    """2 x every matmul weight (the output projection included) + attention scores and sums over
    ``context`` positions."""
    d, f, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or d // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f
    weights = layers * per_layer + d * config["vocab_size"]
    return 2 * weights + 4 * layers * q * context


def weight_bytes_gguf(path: str) -> int:
    """Bytes of the matmul weights llama.cpp reads per decode step (norms and biases are tiny)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="threads for both engines (0: every core)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--weight-format", default="auto", choices=("auto", "float32", "fp16-packed"),
                    help="ours: engine.weight_format")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="ours: engine.dtype (auto: bfloat16 on a CPU with native bf16, where fp16-packed cannot run)")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--n-ctx", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--n-seq", type=int, default=0, help=argparse.SUPPRESS)
    add_common_args(ap)
    args = ap.parse_args()
    args.threads = args.threads or os.cpu_count() or 1
    if args.worker:
        worker_main(args.worker, args.threads, args.n_ctx, args.n_seq, args.weight_format, args.dtype)
        return 0

    from engine_throughput import make_prompts
    from transformers import AutoTokenizer

    from rayrl.models import resolve_model_path

    quick = args.quick
    new = 8 if quick else args.new_tokens
    lo, hi = (32, 64) if quick else (64, 128)
    concurrency = (8, 32)
    # warmed once at the largest shape (below), so no round is thrown away; the 32-request rounds are
    # the long ones (~40 s on 2 cores), so they stop sooner
    rounds = dict(min_rounds=2, max_rounds=2) if quick else dict(min_rounds=5, max_rounds=9, budget_s=60)
    long_rounds = dict(rounds, min_rounds=2) if quick else dict(rounds, min_rounds=3, budget_s=100)
    record = Record("engine_vs_llamacpp", "CPU engine against llama.cpp (SmolLM2-135M-Instruct)", quick=quick,
                    record_dir=args.record_dir)
    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:
        record.note(f"llama-cpp-python is not installed ({err}): pip install -e '.[bench]' (builds from source)")
        record.save()
        return 1
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    n_ctx = 256 * -(-max(concurrency) * (hi + new + 16) // 256)
    workers = {side: Worker(side, args, n_ctx, max(concurrency)) for side in SIDES}
    heads: dict[tuple[str, int], dict[str, list[list[int]]]] = {}
    try:
        info = {side: w.call("info") for side, w in workers.items()}
        cfg = info["ours"]["config"]

        def measure(name: str, n: int, plo: int, phi: int, new_tokens: int) -> dict[str, dict[str, Spread]]:
            """Both sides' k-th runs get the same fresh prompts (no run reuses an earlier run's)."""
            prompts: list[list[list[int]]] = []
            calls = {side: 0 for side in SIDES}

            def side(which: str):
                def go() -> dict[str, float]:
                    k = calls[which]
                    calls[which] += 1
                    if k == len(prompts):
                        prompts.append(make_prompts(tokenizer, n, plo, phi, seed=1000 * n + phi + 7919 * k))
                    r = workers[which].call("run", prompts[k], new_tokens)
                    heads.setdefault((name, k), {})[which] = r["head"]
                    decode = r["wall"] - max(r["first"])
                    # FLOPs of every token processed (prompt and generated), each at its mean context
                    work = sum((len(p) + new_tokens) * flops_per_token(cfg, (len(p) + new_tokens) / 2)
                               for p in prompts[k])
                    step = sum(flops_per_token(cfg, len(p) + new_tokens / 2) for p in prompts[k])
                    return {"tok_s": n * new_tokens / r["wall"], "ttft_ms": r["first"][0] * 1e3,
                            "prefill_s": max(r["first"]),
                            "decode_ms_step": 1e3 * decode / (new_tokens - 1) if new_tokens > 1 else 0.0,
                            "decode_tok_s": (new_tokens - 1) / decode if new_tokens > 1 else 0.0,
                            "flop_s": work / r["wall"], "decode_flop_s": (new_tokens - 1) * step / decode
                            if new_tokens > 1 else 0.0}
                return go

            return alternate({s: side(s) for s in SIDES}, label=name, warmup=0,
                             **(long_rounds if n == max(concurrency) else rounds))

        warm = make_prompts(tokenizer, max(concurrency), hi, hi, seed=1)
        for w in workers.values():  # KV buffers and compute graphs at their largest, once
            w.call("run", warm, 2)
        results = {"batch-1 decode": measure("batch 1", 1, 24, 24, new)}
        for n in concurrency:
            results[f"{n} concurrent"] = measure(f"{n} concurrent", n, lo, hi, new)
        results["time to first token, 300-token prompt"] = measure("ttft 300", 1, 300, 300, 1)
        roof = workers["ours"].call("roofline")
        profiles = {name: workers["ours"].call("profile", make_prompts(tokenizer, n, a, b, seed=424242 + n), new)
                    for name, n, a, b in (("batch-1 decode", 1, 24, 24), *((f"{n} concurrent", n, lo, hi)
                                                                           for n in concurrency))}
    finally:
        for w in workers.values():
            w.close()

    goals = report(record, info, results, roof, new, (lo, hi))
    weight_bytes = {"ours": info["ours"]["weight_bytes"], "llama.cpp": weight_bytes_gguf(str(_gguf_path()))}
    report_profile(record, info, results, profiles, new, goals, weight_bytes)
    pairs = [(a, b) for h in heads.values() if len(h) == 2 for a, b in zip(h["ours"], h["llama.cpp"])]
    n_tok = min(HEAD, new)
    record.note(f"check: over {len(pairs)} sequences both engines decoded, the first generated token agrees in "
                f"{sum(a[0] == b[0] for a, b in pairs) / max(len(pairs), 1):.0%} and the first {n_tok} in "
                f"{sum(a[:n_tok] == b[:n_tok] for a, b in pairs) / max(len(pairs), 1):.0%} (greedy; the weights "
                "differ by llama.cpp's quantisation, so a near tie can flip)")
    record.save()
    return 0


def report(record: Record, info: dict[str, Any], results: dict[str, dict], roof: dict[str, float], new: int,
           prompt_range: tuple[int, int]) -> dict[str, bool]:
    """The comparison and roofline tables; returns each row's goal, met or not."""
    ours, llama = info["ours"], info["llama.cpp"]
    record.note(f"ours: rayrl CPUEngine, dtype {ours['dtype']} (engine.dtype from --dtype), dequantised "
                f"weights, decode path {ours['decode_path']} (step on {ours['decode_attention']}), weight format "
                f"{ours['weight_format']} (packed at load in {ours['load_pack_s']:.2f} s), {ours['threads']} torch "
                f"threads. "
                f"llama.cpp: llama-cpp-python {llama['version']}, "
                f"{llama['gguf']} as quantised (Q4_1 linear layers, Q8_0 embedding/output), {llama['threads']} "
                f"threads, batched C API (llama_batch/llama_decode; its server has no parallel slots), "
                f"n_batch {llama['n_batch']}. Same token ids, greedy, {new} new tokens, no early stop.")
    figure = {"batch-1 decode": ("decode_tok_s", "tokens/s after the first token", 1)}
    figure.update({name: ("tok_s", "generated tokens/s incl. prefill", 1) for name in results if "concurrent" in name})
    figure["time to first token, 300-token prompt"] = ("ttft_ms", "ms (lower is better)", 0)
    rows, goals = [], []
    for name, (key, unit, digits) in figure.items():
        a, b = results[name]["ours"][key], results[name]["llama.cpp"][key]
        ratio = paired_ratio(a, b)
        rows.append([name, a.fmt(digits), b.fmt(digits), ratio.fmt(2, "x"), unit])
        record.figure(name, {"ours": a, "llama.cpp": b, "ratio": ratio})
        if name == "batch-1 decode":
            goals.append((name, "at least 0.4x llama.cpp at batch 1", ratio.median >= 0.4))
        elif "concurrent" in name:
            goals.append((name, f"at least 1.5x llama.cpp at {name}", ratio.median >= 1.5))
    record.table(f"median [IQR] (min-max, n) over alternating rounds; ours/llama.cpp is the median of per-round "
                 f"ratios; prompts of {prompt_range[0]}-{prompt_range[1]} tokens in the concurrent rows",
                 ["measurement", "ours", "llama.cpp", "ours/llama.cpp", "unit"], rows)

    peak, bw = roof["matmul_flops"], roof["copy_bytes_per_s"]
    weight_bytes = {"ours": ours["weight_bytes"], "llama.cpp": weight_bytes_gguf(str(_gguf_path()))}
    roof_rows = []
    for side in SIDES:
        tok_s = results["batch-1 decode"][side]["decode_tok_s"].median
        flop_s = results["batch-1 decode"][side]["decode_flop_s"].median
        wb = weight_bytes[side]
        roof_rows.append([f"batch-1 decode, {side}", f"{tok_s:.1f}", f"{flop_s / 1e9:.1f}", f"{flop_s / peak:.1%}",
                          f"{wb / 2**20:.0f} MiB", f"{bw / wb:.0f}", f"{tok_s * wb / bw:.0%}"])
    for name in (n for n in results if "concurrent" in n):
        for side in SIDES:
            r = results[name][side]
            roof_rows.append([f"{name}, {side}", f"{r['tok_s'].median:.1f}", f"{r['flop_s'].median / 1e9:.1f}",
                              f"{r['flop_s'].median / peak:.1%}", "", "", ""])
    record.table(f"roofline: float32 matmul peak {peak / 1e9:.1f} GFLOP/s and copy bandwidth {bw / 1e9:.1f} GB/s "
                 f"(torch, {ours['threads']} threads, this run); the model costs "
                 f"{flops_per_token(ours['config'], 0) / 1e6:.0f} MFLOP per token plus attention; the concurrent "
                 "rows count prompt and generated tokens as processed. Batch-1 decode is bound by the weight bytes "
                 "read per token, so its bandwidth roof is shown too",
                 ["engine", "tokens/s", "GFLOP/s", "share of FLOP peak", "weights read/token",
                  "bandwidth roof tok/s", "share of bandwidth roof"], roof_rows)
    record.figure("roofline", roof)
    record.note("goal: " + "; ".join(f"{goal}: {'met' if ok else 'NOT met'}" for _, goal, ok in goals))
    return {row: ok for row, _, ok in goals}


def _gguf_path() -> Path:
    from rayrl.models import _gguf_location

    return _gguf_location()


if __name__ == "__main__":
    sys.exit(main())
