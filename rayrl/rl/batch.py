"""One step's training batch: the samples of its scored episodes with their advantages.

The advantage of an episode comes from the estimator ``algorithm.advantage_estimator`` names
(rayrl/rl/advantages.py: GRPO and the others measure an episode's reward against its group, no value
model), over the rewards after shaping (rayrl/rl/shaping.py). Every sample an episode produced (one per
linearized trajectory branch) trains with its episode's advantage. Scored episodes (rayrl/rl/failures.py
``is_scored``) are the ones that completed and the ones the agent or the reward failed by its own doing,
with the reward the reward function gave them (0.0 for every built-in reward). Infrastructure failures
are counted but never trained: their reward says nothing about the policy, so the group's baseline is
taken without them. A per-token term (on-policy distillation, rayrl/rl/distill.py) turns a sample's
advantage into one value per response token (``token_advantages``). A batch where no sample would
train (every advantage zero and no other loss term on; rayrl/rl/updates.py ``sample_trains``) carries
no gradient, and the pipeline skips the trainer step for it (``Batch.trains``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from rayrl.config.algorithm import AlgorithmConfig
from rayrl.rl.advantages import EstimatorInput, EstimatorOptions, estimate
from rayrl.rl.failures import is_scored
from rayrl.rl.shaping import shaped_rewards
from rayrl.rl.staleness import sample_staleness
from rayrl.rl.updates import sample_trains
from rayrl.types import Episode, Sample


@dataclass
class Batch:
    """``samples`` with ``advantages`` (one per sample, its episode's), in episode order; how many of the
    step's episodes completed (``episodes_ok``) or failed (``episodes_failed``), and how many of the failed
    ones were infrastructure failures left out of the batch (``episodes_excluded``).

    ``token_advantages``: when a per-token term changed them, each sample's advantages per response
    token (aligned with ``loss_mask``); the trainer then uses these instead of ``advantages``.
    ``metrics``: what building the batch measured (reward shaping, distillation), already named.
    """

    samples: list[Sample]
    advantages: list[float]
    episodes_ok: int
    episodes_failed: int
    episodes_excluded: int = 0
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    token_advantages: Optional[list[np.ndarray]] = None
    metrics: dict[str, float] = field(default_factory=dict)

    def train_advantages(self) -> list[float | np.ndarray]:
        """What the trainer gets per sample: a float, or an array over the response tokens."""
        if self.token_advantages is not None:
            return list(self.token_advantages)
        return list(self.advantages)

    @property
    def trains(self) -> bool:
        """Whether a trainer step would learn anything: some sample trains (rayrl/rl/updates.py)."""
        return any(sample_trains(s, a, self.algorithm) for s, a in zip(self.samples, self.train_advantages()))

    def staleness(self, version: int) -> list[int]:
        """Per sample with trained tokens: policy versions between ``version`` (the weights about to
        train) and its oldest trained token."""
        return sample_staleness(self.samples, version)


def build_batch(episodes: Sequence[Episode], algorithm: AlgorithmConfig | None = None) -> Batch:
    """The batch of one step's episodes: rewards shaped, then advantages from the configured estimator
    over the scored episodes (default: GRPO)."""
    algo = algorithm if algorithm is not None else AlgorithmConfig()
    scored = [e for e in episodes if is_scored(e)]
    rewards, shaping = shaped_rewards(scored, algo)
    tokens = [sum(s.num_trained_tokens for s in e.samples) for e in scored]
    options = EstimatorOptions(grpo_std=algo.grpo_std, singleton_groups=algo.singleton_groups)
    adv = estimate(algo.advantage_estimator, EstimatorInput.of(rewards, [e.group_id for e in scored], tokens, options))
    samples: list[Sample] = []
    advantages: list[float] = []
    for e, a in zip(scored, adv):
        for s in e.samples:
            samples.append(s)
            advantages.append(float(a))
    ok = sum(1 for e in episodes if e.ok)
    return Batch(samples, advantages, episodes_ok=ok, episodes_failed=len(episodes) - ok,
                 episodes_excluded=len(episodes) - len(scored), algorithm=algo, metrics=shaping)
