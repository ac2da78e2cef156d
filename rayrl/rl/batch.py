"""One step's training batch: the samples of its scored episodes with their GRPO advantages.

GRPO needs no value model: an episode's advantage is its reward measured against the other episodes of
its group (same task), :func:`grpo_advantages`. Every sample an episode produced (one per linearized
trajectory branch) trains with its episode's advantage. Scored episodes (rayrl/rl/failures.py
``is_scored``) are the ones that completed and the ones the agent or the reward failed by its own doing,
with the reward the reward function gave them (0.0 for every built-in reward). Infrastructure failures
are counted but never trained: their reward says nothing about the policy, so the group's baseline is
taken without them. A batch where every advantage is zero (each group's rewards all equal) carries no
gradient, and the pipeline skips the trainer step for it (``Batch.trains``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from rayrl.rl.failures import is_scored
from rayrl.types import Episode, Sample


def grpo_advantages(
    rewards: Sequence[float], group_ids: Sequence[str], normalize_std: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """Group-normalised advantages: (r - mean(group)) / (std(group) + eps).

    ``std`` is the population standard deviation of the group's rewards. A group whose rewards are all
    equal gets zero advantages (it carries no learning signal under GRPO).
    """
    rewards_arr = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(rewards_arr)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, gid in enumerate(group_ids):
        groups[gid].append(i)
    for idx in groups.values():
        r = rewards_arr[idx]
        centred = r - r.mean()
        if normalize_std:
            centred = centred / (r.std() + eps)
        out[idx] = centred
    return out.astype(np.float32)


@dataclass
class Batch:
    """``samples`` with ``advantages`` (one per sample, its episode's), in episode order; how many of the
    step's episodes completed (``episodes_ok``) or failed (``episodes_failed``), and how many of the failed
    ones were infrastructure failures left out of the batch (``episodes_excluded``)."""

    samples: list[Sample]
    advantages: list[float]
    episodes_ok: int
    episodes_failed: int
    episodes_excluded: int = 0

    @property
    def trains(self) -> bool:
        """Whether a trainer step would learn anything: some advantage is not zero."""
        return any(a != 0.0 for a in self.advantages)

    def staleness(self, version: int) -> list[int]:
        """Per sample with trained tokens: policy versions between ``version`` (the weights about to
        train) and its oldest trained token."""
        return [version - v for s in self.samples if (v := s.oldest_version()) is not None]


def build_batch(episodes: Sequence[Episode], normalize_std: bool) -> Batch:
    """The batch of one step's episodes: GRPO advantages over each group's scored episodes
    (``normalize_std``: divide by the group's reward std, ``trainer.normalize_advantage_std``)."""
    scored = [e for e in episodes if is_scored(e)]
    adv = grpo_advantages([e.reward for e in scored], [e.group_id for e in scored], normalize_std)
    samples: list[Sample] = []
    advantages: list[float] = []
    for e, a in zip(scored, adv):
        for s in e.samples:
            samples.append(s)
            advantages.append(float(a))
    ok = sum(1 for e in episodes if e.ok)
    return Batch(samples, advantages, episodes_ok=ok, episodes_failed=len(episodes) - ok,
                 episodes_excluded=len(episodes) - len(scored))
