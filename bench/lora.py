"""Full weights against LoRA (rank 16 on every linear layer) on the default model, side by side.

Trainer (each side in a process of its own, so peak RSS is the side's own; the sides take turns, the
order rotating each round, bench/measure.py): seconds per trainer step on a calculator-shaped batch, and
its forward, backward and optimizer parts
(the default run's 4 groups x 4 episodes of 192 prompt + 61 response tokens, 49 of them trained;
:data:`RESPONSE_SPANS`), peak trainer
RSS beside the peak of live malloc'd bytes (the difference is memory the allocator keeps after tensors
are freed), checkpoint size, bytes per weight update.

Engine (one real ``cpu_server`` process, SmolLM2's default fp16-packed decode weights): seconds per
weight update, full weights as shared-memory handles (the CPU default) against the adapter through
SGLang's LoRA routes (unload + load + version: the engine merges it and repacks those matrices); and
what applying the adapter at decode instead would cost per decode step (the two small matmuls per
adapted layer, timed at the model's shapes), against the engine's own decode step, to say which is
faster for RL's update-then-generate cycle.

    python bench/lora.py [--model smollm2-135m-instruct] [--rank 16] [--only trainer|engine] [--earlier RECORD]
                         [--checkpointing] [--quick]

``--checkpointing`` adds a third trainer side, LoRA with ``trainer.gradient_checkpointing``, against the same
full side: what memory it saves and what time it costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from measure import Record, add_common_args, alternate, paired_ratio  # noqa: E402

from rayrl.config import EngineConfig, LoraConfig, TrainerConfig  # noqa: E402
from rayrl.engines.client import EngineClient  # noqa: E402
from rayrl.engines.launcher import EngineProcess  # noqa: E402
from rayrl.models import resolve_model_path  # noqa: E402
from rayrl.types import Sample  # noqa: E402
from rayrl.weights.adapter import AdapterSender  # noqa: E402
from rayrl.weights.handles import HandleSender  # noqa: E402
from rayrl.weights.transfer import EngineTarget  # noqa: E402

# The default calculator run's batch (examples/calculator/config.yaml), as its gateway renders a two-turn
# episode for SmolLM2: 4 prompts x 4 episodes; a 192-token prompt of which the first 175 (system prompt and
# two worked examples) are the same in every episode and the rest is the group's question; 61 response
# tokens: a tool call (26, trained), the tool's output and the next turn's header (12, not trained), the
# answer (23, trained).
GROUPS, GROUP_SIZE, SHARED, PROMPT = 4, 4, 175, 192
RESPONSE_SPANS = ((26, 1.0), (12, 0.0), (23, 1.0))
RESPONSE = sum(n for n, _ in RESPONSE_SPANS)
EPISODES, MAX_TURNS, TURN_TOKENS = GROUPS * GROUP_SIZE, 3, 48  # rollout.max_turns, rollout.max_tokens
TRAINED = int(sum(n * m for n, m in RESPONSE_SPANS))


def batch(seed: int) -> tuple[list[Sample], list[float]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(10, 40000, size=SHARED)
    loss_mask = np.concatenate([np.full(n, m) for n, m in RESPONSE_SPANS])
    samples, advantages = [], []
    for _ in range(GROUPS):
        prompt = np.concatenate([shared, rng.integers(10, 40000, size=PROMPT - SHARED)])
        for k in range(GROUP_SIZE):
            tokens = np.concatenate([prompt, rng.integers(10, 40000, size=RESPONSE)]).astype(np.int32)
            samples.append(Sample(tokens=tokens, prompt_length=PROMPT, loss_mask=loss_mask.copy(),
                                  policy_versions=np.zeros(RESPONSE),
                                  rollout_logprobs=np.full(RESPONSE, -3.0, np.float32)))
            advantages.append(1.0 if k % 2 else -1.0)
    return samples, advantages


def trainer_cfg(rank: int, checkpointing: bool = False) -> TrainerConfig:
    return TrainerConfig(lr=1e-5, micro_batch_tokens=4096, lora=LoraConfig(rank=rank),
                         gradient_checkpointing=checkpointing)


class HeapPeak:
    """The process's peak of live malloc'd bytes (glibc's ``mallinfo2``: in-use heap chunks plus mmapped
    ones), sampled every ``period_s`` in a thread: set beside peak RSS, it says how much of the RSS is memory
    the allocator holds freed (fragmentation) rather than tensors alive. None off glibc."""

    def __init__(self, period_s: float = 0.01) -> None:
        import ctypes
        import threading

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in
                        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

        try:
            self._mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
        except (OSError, AttributeError):
            self._mallinfo2, self.peak_mb = None, None
            return
        self._mallinfo2.restype = MallInfo2
        self.peak_mb = 0.0
        self._period = period_s
        threading.Thread(target=self._run, daemon=True).start()

    def live_mb(self) -> float:
        info = self._mallinfo2()
        return (info.uordblks + info.hblkhd) / 2**20

    def _run(self) -> None:
        while True:
            self.peak_mb = max(self.peak_mb, self.live_mb())
            time.sleep(self._period)


def child(args: argparse.Namespace) -> None:
    """One side: build the trainer, run steps, report step seconds (and their forward, backward and
    optimizer parts), peak RSS and peak live heap, checkpoint and update sizes."""
    from rayrl.trainers.torch_backend import TorchTrainer

    torch.set_num_threads(args.threads)
    heap = HeapPeak()
    trainer = TorchTrainer(resolve_model_path(args.model), trainer_cfg(args.rank, args.checkpointing), seed=0,
                           device="cpu")
    parts = {"forward": 0.0, "optimizer": 0.0}

    def timed(name, fn):
        def call(*a, **k):
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[name] += time.perf_counter() - started
        return call

    trainer.token_logprobs = timed("forward", trainer.token_logprobs)  # every pass's forward, to the log-probs
    trainer._reduce_and_step = timed("optimizer", trainer._reduce_and_step)  # clip + AdamW
    seconds, split = [], []
    for step in range(args.steps + 1):  # the first step warms up (allocations, AdamW state)
        samples, advantages = batch(step)
        parts.update(forward=0.0, optimizer=0.0)
        started = time.perf_counter()
        trainer.train_step(samples, advantages)
        if step:
            seconds.append(time.perf_counter() - started)
            split.append((parts["forward"], seconds[-1] - parts["forward"] - parts["optimizer"], parts["optimizer"]))
    with tempfile.TemporaryDirectory() as tmp:
        trainer.save_checkpoint(tmp)
        checkpoint = sum(f.stat().st_size for f in Path(tmp).iterdir())
    update = sum(t.numel() * t.element_size() for _, t in trainer.named_weights(torch.float32))
    forward, backward, optimizer = (float(np.median(col)) for col in zip(*split))
    out = {"step_s": float(np.median(seconds)), "forward_s": forward, "backward_s": backward,
           "optimizer_s": optimizer,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "checkpoint_mb": checkpoint / 1e6, "update_mb": update / 1e6}
    if heap.peak_mb is not None:
        out["peak_heap_mb"] = heap.peak_mb
    print(json.dumps(out))


def run_side(args: argparse.Namespace, rank: int, checkpointing: bool = False) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", "--rank", str(rank), "--model", args.model,
                          "--steps", str(args.steps), "--threads", str(args.threads)]
                         + (["--checkpointing"] if checkpointing else []),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_overhead(model_path: Path, rank: int, batch_size: int, repeats: int) -> float:
    """Seconds per decode step that LoRA applied at decode adds: x A^T then (.) B^T for every adapted
    linear layer, float32, ``batch_size`` tokens."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    head = c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head
    shapes = [(c.hidden_size, c.hidden_size), (c.hidden_size, kv), (c.hidden_size, kv), (c.hidden_size, c.hidden_size),
              (c.hidden_size, c.intermediate_size), (c.hidden_size, c.intermediate_size),
              (c.intermediate_size, c.hidden_size)] * c.num_hidden_layers
    mats = [(torch.randn(rank, i) * 0.01, torch.randn(o, rank) * 0.01, torch.randn(batch_size, i)) for i, o in shapes]
    best = []
    for _ in range(repeats):
        started = time.perf_counter()
        for a, b, x in mats:
            (x @ a.T) @ b.T
        best.append(time.perf_counter() - started)
    return float(np.median(best))


def engine_side(args: argparse.Namespace, record: Record, rounds: dict) -> None:
    from rayrl.trainers.torch_backend import TorchTrainer

    path = resolve_model_path(args.model)
    full = TorchTrainer(path, trainer_cfg(0), seed=0, device="cpu")
    lora = TorchTrainer(path, trainer_cfg(args.rank), seed=0, device="cpu")
    with torch.no_grad():  # a non-zero adapter, as after training
        for p in lora.model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.01)
    full_state = list(full.named_weights(torch.float32))
    lora_state = list(lora.named_weights(torch.float32))
    cfg = EngineConfig(dtype="float32", max_batch_size=32, context_length=2048, num_threads=args.threads,
                       startup_timeout_s=300, max_lora_rank=args.rank)
    loop = asyncio.new_event_loop()
    versions = iter(range(1, 10**6))
    with tempfile.TemporaryDirectory() as logs, EngineProcess(cfg, str(path), Path(logs) / "engine.log") as proc:
        client = EngineClient(proc.url)
        handles = HandleSender([EngineTarget(EngineClient(proc.url))], bucket_bytes=512 << 20, flattened=True)
        adapter = AdapterSender([EngineTarget(EngineClient(proc.url))], lora.adapter_config())

        async def full_update() -> float:
            if await client.lora_adapters():  # full weights are refused under a merged adapter
                await client.unload_lora_adapter(adapter.name)
            version = next(versions)
            started = time.perf_counter()
            await handles.send(iter(full_state), version)
            return time.perf_counter() - started

        async def lora_update() -> float:
            await adapter.connect()  # whether the full side left it loaded (it unloads it)
            version = next(versions)
            started = time.perf_counter()
            await adapter.send(iter(lora_state), version)
            return time.perf_counter() - started

        async def decode_step() -> float:
            prompts = [[5 + i, 17, 42, 99, 7, 3] for i in range(EPISODES)]
            started = time.perf_counter()
            await asyncio.gather(*(client.generate(p, {"max_new_tokens": TURN_TOKENS, "temperature": 0.0,
                                                       "ignore_eos": True}, lora_path=adapter.name) for p in prompts))
            return (time.perf_counter() - started) / TURN_TOKENS

        loop.run_until_complete(handles.connect())
        loop.run_until_complete(adapter.connect())
        res = alternate({"full weights (shm handles)": lambda: loop.run_until_complete(full_update()),
                         f"LoRA r{args.rank} (adapter routes, merged)": lambda: loop.run_until_complete(lora_update())},
                        label="updates", **rounds)
        res = {name: figs["value"] for name, figs in res.items()}
        names = list(res)
        record.table("Weight update into the CPU engine, seconds", ["side", "s per update", "bytes", "ratio to full"],
                     [[names[0], res[names[0]].fmt(3), f"{sum(t.numel() * 4 for _, t in full_state) / 1e6:.1f} MB",
                       "1"],
                      [names[1], res[names[1]].fmt(3), f"{sum(t.numel() * 4 for _, t in lora_state) / 1e6:.2f} MB",
                       paired_ratio(res[names[1]], res[names[0]]).fmt(3)]])
        loop.run_until_complete(lora_update())  # the adapter merged: decode with it
        step = [loop.run_until_complete(decode_step()) for _ in range(3)]
        loop.run_until_complete(handles.close())
        loop.run_until_complete(adapter.close())
        loop.run_until_complete(client.close())
    decode_s = float(np.median(step))
    extra = decode_overhead(path, args.rank, EPISODES, 5 if args.quick else 20)
    merge_s = res[names[1]].median
    generated = sum(n for n, m in RESPONSE_SPANS if m)  # decode steps of a rollout: the episodes decode together
    most = MAX_TURNS * TURN_TOKENS
    record.table(f"Merged at update vs applied at decode (CPU engine, batch {EPISODES})", ["figure", "value"], [
        [f"engine decode step (merged weights, batch {EPISODES})", f"{decode_s * 1e3:.2f} ms"],
        ["added per decode step if applied at decode (2 small matmuls x 7 x layers)", f"{extra * 1e3:.2f} ms"],
        ["LoRA update (above: unload + load, merge, repack)", f"{merge_s * 1e3:.1f} ms"],
        ["break-even: decode steps per update above which merging is faster", f"{merge_s / extra:.0f}"],
        [f"decode steps per calculator rollout: the batch's two turns / at most {MAX_TURNS} x {TURN_TOKENS}",
         f"{generated} / {most}"],
        ["applied at decode, added per rollout (the two figures above)",
         f"{extra * generated * 1e3:.0f} / {extra * most * 1e3:.0f} ms"],
    ])
    record.figure("decode_overhead_ms", extra * 1e3)
    record.figure("decode_step_ms", decode_s * 1e3)
    record.figure("merge_update_ms", merge_s * 1e3)


def earlier_table(path: Path, title: str, columns: list[str]) -> tuple[str, list]:
    """The trainer table of an earlier run with the same settings (its record), to show under this run's: what
    changed between two commits, each run's sides paired within it. Checked before this run starts."""
    earlier = json.loads(path.read_text())
    table = next((t for t in earlier.get("tables", []) if t["title"] == title and t["columns"] == columns), None)
    if table is None:
        raise SystemExit(f"--earlier {path}: no trainer table with this run's settings ({title})")
    load = " / ".join(f"{x:.2f}" for x in (earlier["load_start"][0], earlier["load_end"][0]))
    return (f"The same figures from the earlier run `{earlier['command']}` ({earlier['started']}, commit "
            f"{earlier.get('commit')}, load {load} at start / end)", table["rows"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=("trainer", "engine"), help="run one part (default: both)")
    parser.add_argument("--earlier", type=Path, help="an earlier trainer record (runs/bench/lora.json) with the "
                        "same settings: its figures are shown under this run's")
    parser.add_argument("--checkpointing", action="store_true", help="a third side: LoRA with "
                        "trainer.gradient_checkpointing (each layer recomputed in the backward pass), against the "
                        "same full side (without it)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_common_args(parser)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.steps = 1
    rounds = dict(min_rounds=2, max_rounds=2) if args.quick else dict(min_rounds=3, max_rounds=5, budget_s=900)
    part = {"trainer": ": trainer", "engine": ": engine"}.get(args.only or "", "")  # a part keeps its own section
    record = Record("lora", f"Full weights vs LoRA rank {args.rank} (every linear layer), {args.model}{part}",
                    quick=args.quick, record_dir=args.record_dir)
    title = (f"Trainer, {GROUPS}x{GROUP_SIZE} samples of {PROMPT}+{RESPONSE} tokens ({TRAINED} trained), "
             f"{args.threads} threads, {args.steps} steps per side per round")
    columns = ["figure", "full", f"LoRA r{args.rank}", "LoRA / full"]
    ckpt = f"LoRA r{args.rank} + checkpointing"
    earlier = earlier_table(args.earlier, title, columns) if args.earlier and args.only != "engine" else None
    if args.only != "engine":
        sides = {"full": lambda: run_side(args, 0), f"LoRA r{args.rank}": lambda: run_side(args, args.rank)}
        if args.checkpointing:
            sides[ckpt] = lambda: run_side(args, args.rank, checkpointing=True)
        res = alternate(sides, label="trainer sides", warmup=0, **rounds)  # each side's process warms itself up
        full, lora = res["full"], res[f"LoRA r{args.rank}"]
        rows = []
        figures = (("step_s", "trainer step, s", 2),
                   ("forward_s", "of which forward to the log-probs, s", 2),
                   ("backward_s", "of which loss and backward, s", 2),
                   ("optimizer_s", "of which clip + AdamW, s", 2),
                   ("peak_rss_mb", "peak trainer RSS, MB", 0),
                   ("peak_heap_mb", "peak live heap (malloc'd, in use), MB", 0),
                   ("checkpoint_mb", "checkpoint, MB", 1),
                   ("update_mb", "bytes per weight update, MB", 1))
        for key, label, digits in figures:
            if key not in full or key not in lora:
                continue
            ratio = paired_ratio(lora[key], full[key]).fmt(3)
            rows.append([label, full[key].fmt(digits), lora[key].fmt(digits), ratio])
            if args.checkpointing:
                rows[-1] += [res[ckpt][key].fmt(digits), paired_ratio(res[ckpt][key], full[key]).fmt(3)]
        record.table(title, columns + ([ckpt, f"{ckpt} / full"] if args.checkpointing else []), rows)
        if earlier is not None:
            record.table(earlier[0], columns, earlier[1])
    if args.only != "trainer":
        engine_side(args, record, rounds)
    print(record.save())


if __name__ == "__main__":
    main()
