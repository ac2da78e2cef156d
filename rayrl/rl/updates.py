"""Which samples a step trains, and how its optimizer steps split them: mini-batches, epochs, ranks.

A rollout batch trains in ``trainer.num_steps_per_rollout`` mini-batches per epoch, for
``trainer.epochs_per_rollout`` epochs (PPO's several updates per batch; slime's
``--num-steps-per-rollout``, verl's ``ppo_mini_batch_size`` and ``ppo_epochs``). The split is decided
once, here, by the driver (actors/trainer.py), for every rank at once, because the loss of a
mini-batch is normalised over *all* ranks (rayrl/rl/objective.py): each rank must know the
global trained-token and sequence counts of every mini-batch, and every rank must make the same
number of optimizer steps (their gradients are all-reduced at each).

The split: the samples that train (:func:`sample_trains`) in batch order, cut into contiguous
mini-batches of near-equal sample counts (a GRPO group's samples are adjacent, so a mini-batch holds
whole groups where the sizes allow); each mini-batch is sharded over the data-parallel replicas by
tokens (rayrl/rl/shard.py). Epochs repeat the same mini-batches in the same order: the split is
deterministic, so a resumed run repeats it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from rayrl.config import AlgorithmConfig
from rayrl.rl.policy_losses import policy_loss
from rayrl.rl.shard import rank_shards
from rayrl.types import Sample


def sft_applies(sample: Sample, algo: AlgorithmConfig) -> bool:
    """Whether the SFT term (or the ``sft`` loss) trains ``sample``: its episode reward reaches
    ``algorithm.sft_min_reward`` (rejection sampling), or no threshold is set."""
    return algo.sft_min_reward is None or sample.reward >= algo.sft_min_reward


def sample_trains(sample: Sample, advantage: float | np.ndarray, algo: AlgorithmConfig) -> bool:
    """Whether ``sample`` gives the loss any gradient: it has trained tokens and a nonzero advantage, or a
    term that acts without one is on (entropy, KL, SFT). With a supervised loss (``policy_loss: sft``) only
    the samples the SFT threshold admits train. Samples that would train nothing are left out before the split, so the
    normalisers count only what trains (as the single-update GRPO step always has)."""
    if sample.num_trained_tokens == 0:
        return False
    supervised = policy_loss(algo.policy_loss).supervised
    sft = (supervised or algo.sft_coef > 0) and sft_applies(sample, algo)
    if supervised or sft:
        return sft
    if algo.entropy_coef > 0 or algo.kl_loss_coef > 0 or algo.kl_reward_coef > 0:
        return True
    return bool(np.any(np.asarray(advantage) != 0))


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step's samples on one rank, and the whole mini-batch's size over every replica
    (what the aggregation divides by)."""

    indices: tuple[int, ...]  # positions in the list of samples this rank was sent
    tokens: int  # trained tokens in the mini-batch, all replicas
    sequences: int  # samples in the mini-batch, all replicas


@dataclass(frozen=True)
class UpdatePlan:
    """A rank's optimizer steps for one rollout batch: ``minibatches`` once per epoch."""

    minibatches: tuple[MiniBatch, ...]
    epochs: int = 1

    @property
    def optimizer_steps(self) -> int:
        return len(self.minibatches) * self.epochs

    @classmethod
    def single(cls, samples: Sequence[Sample]) -> UpdatePlan:
        """Everything a rank holds as one mini-batch, counted locally (one rank, one update)."""
        tokens = sum(s.num_trained_tokens for s in samples)
        return cls((MiniBatch(tuple(range(len(samples))), tokens, len(samples)),))


def split_contiguous(indices: Sequence[int], parts: int) -> list[list[int]]:
    """``indices`` cut into ``min(parts, len)`` contiguous runs whose lengths differ by at most one."""
    parts = max(1, min(parts, len(indices)))
    return [list(map(int, chunk)) for chunk in np.array_split(np.asarray(indices, dtype=np.int64), parts)]


def plan_updates(
    samples: Sequence[Sample],
    advantages: Sequence[float | np.ndarray],
    algo: AlgorithmConfig,
    *,
    world_size: int = 1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    num_minibatches: int = 1,
    epochs: int = 1,
) -> list[tuple[list[int], UpdatePlan]]:
    """Per global rank: the batch indices of the samples it trains (in the order it trains them) and its
    :class:`UpdatePlan`. The ranks of one replica get the same (rayrl/rl/shard.py). A batch where nothing
    trains still gets one empty mini-batch, so every rank makes its one optimizer step."""
    keep = [i for i, (s, a) in enumerate(zip(samples, advantages)) if sample_trains(s, a, algo)]
    held: list[list[int]] = [[] for _ in range(world_size)]
    steps: list[list[MiniBatch]] = [[] for _ in range(world_size)]
    for chunk in split_contiguous(keep, num_minibatches) if keep else [[]]:
        tokens = sum(samples[i].num_trained_tokens for i in chunk)
        shards = rank_shards([len(samples[i].tokens) for i in chunk], world_size, tp, pp, cp)
        for rank, shard in enumerate(shards):
            start = len(held[rank])
            held[rank] += [chunk[j] for j in shard]
            steps[rank].append(MiniBatch(tuple(range(start, len(held[rank]))), tokens, len(chunk)))
    return [(held[rank], UpdatePlan(tuple(steps[rank]), epochs)) for rank in range(world_size)]
