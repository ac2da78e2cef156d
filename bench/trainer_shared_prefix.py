"""Torch trainer step with and without ``trainer.share_prefix``, side by side in one run.

A rollout batch of agent episodes: ``--groups`` tasks x ``--group-size`` episodes, every prompt starting
with the same system prompt (``--system-tokens`` long, standing for a harness's system prompt and tool
schemas), then the task's question (shared inside a group) and each episode's own response
(``--response-tokens``). One optimizer step (forward, backward, AdamW) on the real model, repeated;
reported as seconds per step and the ratio. The gradients are the same either way
(tests/test_trainer_weight_sync.py checks that).

    python bench/trainer_shared_prefix.py [--system-tokens 105 1000 4000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from rayrl.config import TrainerConfig
from rayrl.models import resolve_model_path
from rayrl.trainers.torch_backend import TorchTrainer
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


def time_steps(trainer: TorchTrainer, samples: list[Sample], repeats: int) -> float:
    advantages = [(-1.0) ** i for i in range(len(samples))]
    trainer.train_step(samples, advantages)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        trainer.train_step(samples, advantages)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--system-tokens", type=int, nargs="+", default=[105, 1000])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--response-tokens", type=int, nargs=2, default=[60, 160])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    trainers = {share: TorchTrainer(path, TrainerConfig(share_prefix=share, num_threads=args.threads,
                                                        micro_batch_tokens=1 << 20), device="cpu")
                for share in (False, True)}
    print(f"{args.groups} groups x {args.group_size} episodes, question {args.question_tokens} tokens, "
          f"responses {args.response_tokens[0]}-{args.response_tokens[1]} tokens; median of {args.repeats} steps")
    print(f"{'system tokens':>13} {'tokens/batch':>12} {'plain s':>8} {'shared s':>9} {'speed-up':>9}")
    for system in args.system_tokens:
        samples = make_batch(np.random.default_rng(system), system, args.groups, args.group_size,
                             args.question_tokens, tuple(args.response_tokens))
        plain = time_steps(trainers[False], samples, args.repeats)
        shared = time_steps(trainers[True], samples, args.repeats)
        total = sum(len(s.tokens) for s in samples)
        print(f"{system:>13} {total:>12} {plain:>8.2f} {shared:>9.2f} {plain / shared:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
