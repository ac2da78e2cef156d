"""CPU engine throughput, measured side by side with transformers' ``model.generate`` in one run.

(a) Batch throughput: the same prompts and the same number of new tokens (``ignore_eos`` for the engine,
    ``min_new_tokens`` for generate, so both produce exactly N tokens per row) at batch 1, 8 and 32.
    Reported as generated tokens per second, including prefill, and the engine/generate ratio.
(b) Agent turns: 32 requests (prompts of 100-300 tokens, 64 new tokens each) arriving as a Poisson
    process; served by the engine (continuous batching) vs served one at a time with ``model.generate``
    (each waits for the previous one). Reported as the time until the last turn is answered.

    python bench/engine_throughput.py [--model smollm2-135m-instruct] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Sequence

import torch

from rayrl.engines.cpu_engine import DTYPES, CPUEngine
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
    """(total seconds, decode-only seconds after every row has its first token) for the engine."""
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    handles = [engine.submit(p, params) for p in prompts]
    for h in handles:
        assert len(h.result(600).output_ids) == new_tokens
    end = time.perf_counter()
    return end - start, end - max(h.first_token_at for h in handles)


def bench_batches(
    engine: CPUEngine, model, tokenizer, batches: Sequence[int], new_tokens: int, repeats: int
) -> None:
    print(
        f"\n(a) batch throughput: generated tokens/s including prefill, {new_tokens} new tokens per row, "
        f"prompts 100-300 tokens; best of {repeats} interleaved runs per side"
    )
    print(f"{'batch':>6} {'generate':>10} {'engine':>10} {'ratio':>7}   {'decode-only tok/s (batch 1)':>28}")
    for batch in batches:
        prompts = make_prompts(tokenizer, batch, 100, 300, seed=batch)
        engine_generate(engine, prompts[:1], 2)  # warm-up
        hf_generate(model, tokenizer, prompts[:1], 2)
        hf_runs, eng_runs = [], []
        for _ in range(repeats):  # interleaved, so a burst of load elsewhere hits both sides alike
            hf_runs.append(hf_generate(model, tokenizer, prompts, new_tokens))
            eng_runs.append(engine_generate(engine, prompts, new_tokens))
        (t_hf, d_hf), (t_eng, d_eng) = min(hf_runs), min(eng_runs)
        tok = batch * new_tokens
        extra = ""
        if batch == 1:
            extra = f"   generate {(new_tokens - 1) / d_hf:6.1f}  engine {(new_tokens - 1) / d_eng:6.1f}"
        print(f"{batch:>6} {tok / t_hf:>10.1f} {tok / t_eng:>10.1f} {t_hf / t_eng:>6.2f}x{extra}", flush=True)


def bench_agent_turns(engine: CPUEngine, model, tokenizer, turns: int, new_tokens: int, rate: float) -> None:
    prompts = make_prompts(tokenizer, turns, 100, 300, seed=1234)
    rng = random.Random(7)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(rate)
    print(
        f"\n(b) {turns} agent turns, Poisson arrivals at {rate}/s over {arrivals[-1]:.1f} s, "
        f"prompts 100-300 tokens, {new_tokens} new tokens"
    )

    # engine: submit each turn at its arrival time
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    handles = []
    for arrival, prompt in zip(arrivals, prompts):
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        handles.append((arrival, engine.submit(prompt, params)))
    latencies = [h.result(600).e2e_latency for _, h in handles]
    eng_makespan = time.perf_counter() - start

    # one at a time: each turn starts at max(its arrival, the previous turn's end)
    clock, seq_latencies = 0.0, []
    for arrival, prompt in zip(arrivals, prompts):
        begin = max(clock, arrival)
        clock = begin + hf_generate(model, tokenizer, [prompt], new_tokens)[0]
        seq_latencies.append(clock - arrival)
    print(f"{'':>14} {'makespan s':>11} {'mean latency s':>15} {'tokens/s':>9}")
    total = turns * new_tokens
    print(f"{'one at a time':>14} {clock:>11.1f} {sum(seq_latencies) / turns:>15.1f} {total / clock:>9.1f}")
    print(
        f"{'engine':>14} {eng_makespan:>11.1f} {sum(latencies) / turns:>15.1f} {total / eng_makespan:>9.1f}"
    )
    print(f"speed-up (makespan): {clock / eng_makespan:.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per row in (a)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--turns", type=int, default=32)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--rate", type=float, default=2.0, help="agent-turn arrivals per second in (b)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs per side in (a); best is shown")
    ap.add_argument("--num-threads", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: a,b")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    path: Path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).eval()
    engine = CPUEngine(path, dtype=args.dtype, max_batch_size=max(32, args.turns)).start()
    print(f"model {args.model} ({path}), dtype {args.dtype}, torch threads {torch.get_num_threads()}")
    skip = set(args.skip.split(","))
    try:
        if "a" not in skip:
            batches = [int(b) for b in args.batches.split(",")]
            bench_batches(engine, model, tokenizer, batches, args.new_tokens, args.repeats)
        if "b" not in skip:
            bench_agent_turns(engine, model, tokenizer, args.turns, args.turn_tokens, args.rate)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
