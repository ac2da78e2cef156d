"""Torch trainer step with and without ``trainer.share_prefix``, alternating in one run.

A rollout batch of agent episodes: ``--groups`` tasks x ``--group-size`` episodes, every prompt starting
with the same system prompt (``--system-tokens`` long, standing for a harness's system prompt and tool
schemas), then the task's question (shared inside a group) and each episode's own response
(``--response-tokens``). One optimizer step (forward, backward, AdamW) on the real model. The two
trainers (plain, shared) take turns step by step (bench/measure.py), so load elsewhere on the machine
hits both alike; reported: seconds per step (median and spread) and the per-step ratio. The gradients
are the same either way (tests/trainers/test_trainer_weight_sync.py checks that).

The "padded-token bound" column is the most sharing can save by token count alone: a micro-batch pads
every row to the longest, so the plain step computes n x longest positions and the shared step
prefix + n x (longest - prefix). Attention grows faster than linearly in the prefix, so long prefixes
can beat it slightly; the LM head and the optimizer step do not shrink at all.

    python bench/trainer_shared_prefix.py [--system-tokens 105 1000] [--quick]
"""

from __future__ import annotations

import argparse

import numpy as np
from measure import Record, add_common_args, alternate, paired_ratio

from rayrl.config import TrainerConfig
from rayrl.models import resolve_model_path
from rayrl.trainers.torch_backend import TorchTrainer, shared_prefix_length
from rayrl.types import Sample


def make_batch(rng: np.random.Generator, system: int, groups: int, group_size: int, question: int,
               response: tuple[int, int]) -> list[Sample]:
    """Samples with a common system prefix, a per-group question and per-episode responses."""
    head = rng.integers(100, 40000, size=system)
    samples = []
    for _ in range(groups):
        prompt = np.concatenate([head, rng.integers(100, 40000, size=question)]).astype(np.int32)
        for _ in range(group_size):
            n = int(rng.integers(response[0], response[1] + 1))
            tokens = np.concatenate([prompt, rng.integers(100, 40000, size=n)]).astype(np.int32)
            samples.append(Sample(tokens=tokens, prompt_length=len(prompt), loss_mask=np.ones(n, np.int8),
                                  rollout_logprobs=np.full(n, -2.0, np.float32),
                                  policy_versions=np.zeros(n, np.int32)))
    return samples


def padded_token_bound(samples: list[Sample]) -> float:
    """Positions a plain step computes over those a shared step computes (one micro-batch)."""
    n, longest = len(samples), max(len(s.tokens) for s in samples)
    prefix = shared_prefix_length(samples)
    return n * longest / (prefix + n * (longest - prefix))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--system-tokens", type=int, nargs="+", default=[105, 1000])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--response-tokens", type=int, nargs=2, default=[60, 160])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.system_tokens, args.groups, args.group_size, args.response_tokens = [64], 1, 2, [16, 32]
    rounds = dict(min_rounds=2, max_rounds=2) if args.quick else dict(min_rounds=3, max_rounds=9, budget_s=60)
    record = Record("trainer_shared_prefix", "Trainer step with and without trainer.share_prefix",
                    quick=args.quick, record_dir=args.record_dir)
    path = resolve_model_path(args.model)
    trainers = {share: TorchTrainer(path, TrainerConfig(share_prefix=share, num_threads=args.threads,
                                                        micro_batch_tokens=1 << 20), device="cpu")
                for share in (False, True)}
    record.note(f"{args.groups} groups x {args.group_size} episodes, question {args.question_tokens} tokens, "
                f"responses {args.response_tokens[0]}-{args.response_tokens[1]} tokens, one micro-batch; "
                f"float32 master weights, compute dtype {trainers[False].autocast_dtype or 'float32'}")
    rows = []
    for system in args.system_tokens:
        samples = make_batch(np.random.default_rng(system), system, args.groups, args.group_size,
                             args.question_tokens, tuple(args.response_tokens))
        advantages = [(-1.0) ** i for i in range(len(samples))]

        def step(share: bool, samples=samples, advantages=advantages):
            def go() -> dict[str, float]:
                return {"seconds": trainers[share].train_step(samples, advantages)["train_time_s"]}
            return go

        warm = 1 if system == args.system_tokens[0] else 0  # the trainers' first steps set up AdamW's state
        res = alternate({"plain": step(False), "shared": step(True)}, label=f"{system} system tokens", warmup=warm,
                        **rounds)
        plain, shared = res["plain"]["seconds"], res["shared"]["seconds"]
        speedup = paired_ratio(plain, shared)
        rows.append([system, sum(len(s.tokens) for s in samples), plain.fmt(2), shared.fmt(2), speedup.fmt(2, "x"),
                     f"{padded_token_bound(samples):.2f}x"])
        record.figure(f"speedup_{system}", speedup)
    record.table("seconds per optimizer step, median [IQR] (min-max, n), plain and shared alternating; speed-up is "
                 "the median of per-round plain/shared ratios",
                 ["system tokens", "tokens/batch", "plain s", "shared s", "speed-up", "padded-token bound"], rows)
    record.save()


if __name__ == "__main__":
    main()
