"""The lean decode step alone against the CPU engine's decode step, sides alternating in one process.

Why: if the engine's tokens/s lag what its step alone would give, the time goes to sampling, token
bookkeeping, the loop or thread placement, not to the step; this tells which, on the same model, threads
and hour. The step side is bench/decode_step_ab.py's ``Side`` (cached rows decoded at one column); the
engine side submits greedy requests (``ignore_eos``) and takes the wall time from the last first token to
the end per decode step, plus the loop's own ``decode_seconds`` per step.

    python bench/step_vs_engine.py [--threads 2] [--steps 63] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from typing import Any

import torch
from decode_step_ab import Side, rows
from measure import alternate, paired_ratio


def engine_run(engine: Any, batch: int, gen: torch.Generator, steps: int) -> dict[str, float]:
    """``batch`` greedy requests of ``steps + 1`` tokens on ``engine``: ms per decode step, wall and loop."""
    engine.flush_cache()
    lengths = [24] if batch == 1 else torch.randint(64, 129, (batch,), generator=gen).tolist()
    prompts = [torch.randint(10, 40000, (n,), generator=gen).tolist() for n in lengths]
    before = engine.stats()
    start = time.perf_counter()
    params = {"temperature": 0.0, "max_new_tokens": steps + 1, "ignore_eos": True}
    handles = [engine.submit(p, params, return_logprob=False) for p in prompts]
    for h in handles:
        h.result(900)
    wall = time.perf_counter() - start
    after = engine.stats()
    done = max(1, after["decode_steps"] - before["decode_steps"])
    first = max(h.first_token_at for h in handles) - start
    return {"ms_step": 1e3 * (wall - first) / steps,
            "loop_ms_step": 1e3 * (after["decode_seconds"] - before["decode_seconds"]) / done}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weight-format", default="fp16-packed", choices=("float32", "fp16-packed"))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=63, help="decode steps per side per round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from rayrl.engines.cpu.engine import CPUEngine
    from rayrl.engines.cpu.lean_decode import LeanDecoder
    from rayrl.models import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    decoder = LeanDecoder(model, args.weight_format, 1024)
    engine = CPUEngine(path, dtype="float32", max_batch_size=32, num_threads=args.threads,
                       weight_format=args.weight_format).start()
    print(f"load average {os.getloadavg()[0]:.2f}, {args.threads} threads, {args.weight_format}", flush=True)
    try:
        for batch in map(int, args.batches.split(",")):
            side = Side(decoder, *rows(batch, batch))
            gen = torch.Generator().manual_seed(batch)
            sides = {"step": partial(side.run, args.steps),
                     "engine": partial(engine_run, engine, batch, gen, args.steps)}
            res = alternate(sides, min_rounds=args.rounds, max_rounds=args.rounds, label=f"batch {batch}")
            ratio = paired_ratio(res["step"]["ms_step"], res["engine"]["ms_step"])
            print(f"batch {batch}: step alone {res['step']['ms_step'].fmt(2)} ms, engine "
                  f"{res['engine']['ms_step'].fmt(2)} ms per decode step (its loop's decode_seconds "
                  f"{res['engine']['loop_ms_step'].fmt(2)}); step/engine {ratio.fmt(3)}; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
