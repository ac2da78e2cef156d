"""CPU engine throughput, measured side by side with transformers' ``model.generate`` in one run.

(a) Batch throughput: the same prompts and the same number of new tokens (``ignore_eos`` for the engine,
    ``min_new_tokens`` for generate, so both produce exactly N tokens per row) at batch 1 and 8.
    Reported as generated tokens per second, including prefill, and the engine/generate ratio.
(b) Agent turns: 16 requests (prompts of 100-300 tokens, 32 new tokens each) arriving as a Poisson
    process; served by the engine (continuous batching) vs served one at a time with ``model.generate``
    (each waits for the previous one). Reported as the time until the last turn is answered.

The two sides alternate run by run (bench/measure.py); every figure is a median with its spread. The
engine's prefix cache is flushed before each of its runs, since ``generate`` recomputes every prompt.
The dtype is what ``engine.dtype: auto`` resolves to on this machine unless ``--dtype`` says otherwise, and
the engine's decode weights are ``engine.weight_format``'s default (auto) unless ``--weight-format`` says
otherwise.
bench/engine_vs_llamacpp.py compares the engine with llama.cpp instead.

    python bench/engine_throughput.py [--model smollm2-135m-instruct] [--dtype auto] [--weight-format auto] [--quick]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Sequence

import torch
from measure import Record, add_common_args, alternate, paired_ratio

from rayrl.engines.cpu.engine import DTYPES, CPUEngine
from rayrl.machine import compute_dtype, cpu_has_native_bf16
from rayrl.models import resolve_model_path

_WORDS = (
    "the agent reads the file and calls a tool to compute the answer before it writes a short report "
    "about the result of each step while the sandbox keeps running tests on the repository"
).split()


def make_prompts(tokenizer, count: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """Chat-formatted prompts of ``lo``..``hi`` tokens (random word salad inside a real template)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        target = rng.randint(lo, hi)
        words = " ".join(rng.choice(_WORDS) for _ in range(target))
        messages = [
            {"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": words},
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids[:2]) + list(ids[-(target - 2) :]) if len(ids) > target else list(ids)
        prompts.append(ids)
    return prompts


class _FirstStepClock:
    """A generate() streamer that only notes when the first new tokens arrive (end of prefill)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at = 0.0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate(model, tokenizer, prompts: Sequence[list[int]], new_tokens: int) -> tuple[float, float]:
    """(total seconds, decode-only seconds after every row has its first token) for ``model.generate``
    producing ``new_tokens`` per prompt in one left-padded batch."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id or 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    clock = _FirstStepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            streamer=clock if len(prompts) == 1 else None,
        )
    end = time.perf_counter()
    assert out.shape[1] - width == new_tokens, "generate stopped early"
    return end - start, (end - clock.first_token_at) if clock.first_token_at else float("nan")


def engine_generate(engine: CPUEngine, prompts: Sequence[list[int]], new_tokens: int) -> tuple[float, float]:
    """(total seconds, decode-only seconds after every row has its first token) for the engine. The prefix
    cache is flushed first: ``generate`` recomputes every prompt, so the engine must too."""
    engine.flush_cache()
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    handles = [engine.submit(p, params) for p in prompts]
    for h in handles:
        assert len(h.result(600).output_ids) == new_tokens
    end = time.perf_counter()
    return end - start, end - max(h.first_token_at for h in handles)


def bench_batches(record: Record, engine: CPUEngine, model, tokenizer, batches: Sequence[int], new_tokens: int,
                  rounds: dict) -> None:
    rows = []
    for batch in batches:
        prompts = make_prompts(tokenizer, batch, 100, 300, seed=batch)

        def side(fn, prompts=prompts):
            def go() -> dict[str, float]:
                total, decode = fn(prompts)
                return {"total": total, "decode": decode}
            return go

        res = alternate({"generate": side(lambda p: hf_generate(model, tokenizer, p, new_tokens)),
                         "engine": side(lambda p: engine_generate(engine, p, new_tokens))},
                        label=f"batch {batch}", **rounds)
        tok = batch * new_tokens
        hf, eng = (res[s]["total"].scaled(lambda x, tok=tok: tok / x) for s in ("generate", "engine"))
        ratio = paired_ratio(eng, hf)
        row = [batch, hf.fmt(1), eng.fmt(1), ratio.fmt(2, "x"), "", ""]
        if batch == 1:  # decode alone, after the first token
            row[4:] = [res[s]["decode"].scaled(lambda x: (new_tokens - 1) / x).fmt(1) for s in ("generate", "engine")]
        rows.append(row)
        record.figure(f"batch{batch}_engine_over_generate", ratio)
    record.table(f"(a) generated tokens/s including prefill, {new_tokens} new tokens per row, prompts 100-300 "
                 "tokens; median [IQR] (min-max, n), sides alternating; ratio = median of per-round ratios",
                 ["batch", "generate", "engine", "engine/generate", "decode-only generate (batch 1)",
                  "decode-only engine (batch 1)"], rows)


def bench_agent_turns(record: Record, engine: CPUEngine, model, tokenizer, turns: int, new_tokens: int,
                      rate: float, rounds: dict) -> None:
    prompts = make_prompts(tokenizer, turns, 100, 300, seed=1234)
    rng = random.Random(7)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(rate)
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}

    def served_by_engine() -> dict[str, float]:  # each turn submitted at its arrival time
        engine.flush_cache()
        start = time.perf_counter()
        handles = []
        for arrival, prompt in zip(arrivals, prompts):
            delay = start + arrival - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            handles.append(engine.submit(prompt, params))
        latencies = [h.result(600).e2e_latency for h in handles]
        return {"makespan": time.perf_counter() - start, "latency": sum(latencies) / turns}

    def one_at_a_time() -> dict[str, float]:  # each turn starts at max(its arrival, the previous turn's end)
        clock, latencies = 0.0, []
        for arrival, prompt in zip(arrivals, prompts):
            clock = max(clock, arrival) + hf_generate(model, tokenizer, [prompt], new_tokens)[0]
            latencies.append(clock - arrival)
        return {"makespan": clock, "latency": sum(latencies) / turns}

    res = alternate({"one at a time": one_at_a_time, "engine": served_by_engine}, label="agent turns", **rounds)
    rows = [[name, res[name]["makespan"].fmt(1), res[name]["latency"].fmt(1),
             res[name]["makespan"].scaled(lambda x: turns * new_tokens / x).fmt(1)] for name in res]
    speedup = paired_ratio(res["one at a time"]["makespan"], res["engine"]["makespan"])
    rows.append(["speed-up (makespan)", speedup.fmt(2, "x"), "", ""])
    record.table(f"(b) {turns} agent turns, Poisson arrivals at {rate}/s over {arrivals[-1]:.1f} s, prompts "
                 f"100-300 tokens, {new_tokens} new tokens; engine = continuous batching, one at a time = "
                 "model.generate per turn", ["served", "makespan s", "mean latency s", "tokens/s"], rows)
    record.figure("agent_turns_speedup", speedup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                    help="auto: as engine.dtype auto resolves on this machine (rayrl/machine.py)")
    ap.add_argument("--weight-format", default="auto", choices=["auto", "float32", "fp16-packed"],
                    help="the engine's engine.weight_format")
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per row in (a)")
    ap.add_argument("--batches", default="1,8", help="batch sizes in (a) (bench/engine_vs_llamacpp.py covers 32)")
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--rate", type=float, default=2.0, help="agent-turn arrivals per second in (b)")
    ap.add_argument("--num-threads", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: a,b")
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.batches, args.new_tokens, args.turns, args.turn_tokens = "1,8", 8, 4, 8
    rounds_a = dict(min_rounds=2, max_rounds=2, warmup=1) if args.quick else dict(min_rounds=5, max_rounds=9,
                                                                                    budget_s=90)
    rounds_b = dict(min_rounds=1, max_rounds=1, warmup=0) if args.quick else dict(min_rounds=2, max_rounds=2,
                                                                                    warmup=0)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = compute_dtype(args.dtype, cuda=False, native_bf16=cpu_has_native_bf16())
    record = Record("engine_throughput", "CPU engine against transformers generate", quick=args.quick,
                    record_dir=args.record_dir)
    path: Path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    engine = CPUEngine(path, dtype=dtype, max_batch_size=max(32, args.turns), weight_format=args.weight_format).start()
    record.note(f"model {args.model}, dtype {dtype} (--dtype {args.dtype}), engine weights {engine.weight_format}, "
                f"torch threads {torch.get_num_threads()}; "
                "the engine's prefix cache is flushed before every run (generate recomputes every prompt too)")
    skip = set(args.skip.split(","))
    try:
        if "a" not in skip:
            batches = [int(b) for b in args.batches.split(",")]
            bench_batches(record, engine, model, tokenizer, batches, args.new_tokens, rounds_a)
        if "b" not in skip:
            bench_agent_turns(record, engine, model, tokenizer, args.turns, args.turn_tokens, args.rate, rounds_b)
    finally:
        engine.shutdown()
    record.save()


if __name__ == "__main__":
    main()
