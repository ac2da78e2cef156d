"""The lean decode step alone (rayrl/engines/cpu/lean_decode.py), this checkout against a base revision,
sides alternating in one process.

Why: a change to the step moves the engine's tokens/s by a few percent, less than the spread of a whole
engine-against-llama.cpp run (bench/engine_vs_llamacpp.py), so it is measured here first, on the step
only: both sides decode the same cached rows of the real SmolLM2-135M-Instruct at the same column (no
sampling, no scheduler), in the weight format given, rounds alternating in order (measure.alternate).
The base side is the base revision's lean_decode.py and weight_formats.py, loaded from git into this
process over the same model weights; the two sides must give the same greedy tokens.

    python bench/decode_step_ab.py --base c378cbc [--threads 2] [--batches 1,8] [--steps 40] [--rounds 7]
    python bench/decode_step_ab.py --profile 8     # this checkout's step under torch's profiler, batch 8
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Callable

import torch
from measure import ROOT, alternate, paired_ratio

MODULES = ("weight_formats", "lean_decode")  # loaded from the base revision, in this order


def base_module(rev: str) -> types.ModuleType:
    """lean_decode.py of ``rev`` (with that revision's weight_formats.py) as a module of this process. The
    files are written out and imported, so TorchScript can read their source (it compiles the step)."""
    folder = Path(tempfile.mkdtemp(prefix="decode_step_ab_"))
    atexit.register(shutil.rmtree, folder, True)
    for name in MODULES:
        src = subprocess.run(["git", "show", f"{rev}:rayrl/engines/{name}.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        for dep in MODULES:
            src = src.replace(f"rayrl.engines.{dep} import", f"_base_{dep} import")
        (folder / f"_base_{name}.py").write_text(src)
    sys.path.insert(0, str(folder))
    return importlib.import_module("_base_lean_decode")


def rows(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[batch, T]`` and their left-padding mask: batch 1 as the bench's batch-1 row (24 prompt
    tokens plus half of 64 generated), larger batches with contexts of 96-160 (64-128-token prompts)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [56] if batch == 1 else torch.randint(96, 161, (batch,), generator=g).tolist()
    t = max(lengths)
    ids = torch.randint(10, 40000, (batch, t), generator=g)
    mask = torch.zeros(batch, t, dtype=torch.bool)
    for r, n in enumerate(lengths):
        mask[r, t - n:] = True
    return ids, mask


class Side:
    """One decoder over prefilled rows: :meth:`run` decodes ``steps`` steps at one column."""

    def __init__(self, decoder: Any, ids: torch.Tensor, mask: torch.Tensor) -> None:
        from rayrl.engines.cpu.kv_cache import BatchKV, KVBlock, prefill_mask

        self.decoder = decoder
        n, t = ids.shape
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)
        with torch.inference_mode():
            _, keys, values = decoder.prefill(ids, positions, prefill_mask(mask), None, False)
        self.kv = BatchKV(len(decoder.layers), n)
        self.kv.append(KVBlock(keys, values, mask))
        self.step_mask = self.kv.step_mask()
        self.ids, self.positions, self.rows = ids[:, -1], positions[:, -1] + 1, slice(0, n)

    def logits(self) -> torch.Tensor:
        with torch.inference_mode():
            return self.decoder.step(self.ids, self.positions, self.kv, self.rows, self.step_mask)

    def run(self, steps: int) -> dict[str, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.logits()
        return {"ms_step": 1e3 * (time.perf_counter() - wall) / steps,
                "cpu_ms_step": 1e3 * (time.process_time() - cpu) / steps}


def profile(side: Side, steps: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    side.run(3)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        side.run(steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="git revision of the base side")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weight-format", default="fp16-packed", choices=("float32", "fp16-packed"))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=40, help="decode steps per side per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", type=int, default=0, help="profile this checkout's step at this batch size")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from rayrl.engines.cpu.lean_decode import LeanDecoder
    from rayrl.models import resolve_model_path

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m-instruct"),
                                                 dtype=torch.float32).eval()
    new = LeanDecoder(model, args.weight_format, 1024)
    if args.profile:
        profile(Side(new, *rows(args.profile, 0)), args.steps)
        return 0
    old = base_module(args.base).LeanDecoder(model, args.weight_format, 1024)
    for side in (old, new):  # a side whose step fell back to Python would measure the fallback
        if not isinstance(side._run_layers, torch.jit.ScriptFunction):
            raise SystemExit("a side's decode step is not scripted: the comparison would be unfair")
    kinds = ["rayrl kernels" if getattr(side, "kernel", False) else "torch ops (sdpa)" for side in (old, new)]
    print(f"load average {os.getloadavg()[0]:.2f}, {args.threads} threads, base {args.base}; attention: base "
          f"{kinds[0]}, new {kinds[1]}", flush=True)
    for batch in map(int, args.batches.split(",")):
        ids, mask = rows(batch, batch)
        sides = {"base": Side(old, ids, mask), "new": Side(new, ids, mask)}
        a, b = sides["base"].logits(), sides["new"].logits()
        same = bool((a.argmax(-1) == b.argmax(-1)).all())
        gap = float((a.log_softmax(-1) - b.log_softmax(-1)).abs().max())
        runs: dict[str, Callable[[], dict[str, float]]] = {k: (lambda s=s: s.run(args.steps)) for k, s in sides.items()}
        res = alternate(runs, min_rounds=args.rounds, max_rounds=args.rounds, label=f"batch {batch}")
        ratio = paired_ratio(res["base"]["ms_step"], res["new"]["ms_step"])
        cpu_ratio = paired_ratio(res["base"]["cpu_ms_step"], res["new"]["cpu_ms_step"])
        print(f"batch {batch}: base {res['base']['ms_step'].fmt(2)} ms/step, new {res['new']['ms_step'].fmt(2)}; "
              f"base/new {ratio.fmt(3)}; cpu base/new {cpu_ratio.fmt(3)}; greedy same {same}, max |dlogprob| "
              f"{gap:.1e}; load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
