"""Advantage estimators: one number per episode from the step's rewards, chosen by name.

``algorithm.advantage_estimator`` names one of :data:`ESTIMATORS` or a ``package.module:function`` of
your own. The contract every estimator keeps:

- **input** (:class:`EstimatorInput`): the step's *successful* episodes, in batch order. ``rewards``
  (float64, shape [n]) are the episodes' rewards after reward shaping (rayrl/rl/shaping.py);
  ``group_ids`` ([n] strings) say which episodes ran the same task (a group); ``token_counts`` (int64,
  [n]) are the tokens each episode trains (its samples' ``loss_mask`` summed; 0 for an episode that
  trains nothing). Failed episodes are not in the input: a group may hold fewer than
  ``rollout.group_size`` episodes, at least ``rollout.min_group_episodes`` unless its reruns ran out,
  possibly just one. Groups need not be contiguous.
- **output**: float32 array of shape [n], the advantage of each episode; every trained token of every
  sample of the episode gets it. A group whose rewards are all equal should get zeros from a group
  baseline (it carries no signal); the trainer skips samples whose advantage is 0 unless another term
  of the loss (KL, entropy, SFT) trains them.
- **pure**: no state, no randomness; the same input gives the same output on every call.

Per-token terms come later and are the same for every estimator: on-policy distillation's reverse KL
(rayrl/rl/distill.py, driver side) and the KL penalty in the reward (rayrl/trainers/objective.py, on the
trainer ranks, where the reference log-probs are). GAE needs a value model per token, which no backend
holds yet; the config refuses it.

Formulas and papers: docs/algorithms.md. Hand-computed tests: tests/test_advantages.py.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from rayrl.config.registry import named_callable

EPS = 1e-6  # keeps a division by a (near-)zero standard deviation finite


@dataclass(frozen=True)
class EstimatorInput:
    """What an estimator sees (module docstring): one entry per successful episode, batch order."""

    rewards: np.ndarray  # float64 [n]
    group_ids: tuple[str, ...]  # [n]
    token_counts: np.ndarray  # int64 [n]

    @classmethod
    def of(cls, rewards: Sequence[float], group_ids: Sequence[str],
           token_counts: Sequence[int] | None = None) -> EstimatorInput:
        n = len(rewards)
        if len(group_ids) != n or (token_counts is not None and len(token_counts) != n):
            raise ValueError("rewards, group_ids and token_counts must have one entry per episode")
        counts = np.ones(n, np.int64) if token_counts is None else np.asarray(token_counts, np.int64)
        return cls(np.asarray(rewards, np.float64), tuple(group_ids), counts)

    def groups(self) -> list[np.ndarray]:
        """Indices of each group's episodes, groups in order of first appearance."""
        by_id: dict[str, list[int]] = defaultdict(list)
        for i, gid in enumerate(self.group_ids):
            by_id[gid].append(i)
        return [np.asarray(idx) for idx in by_id.values()]


EstimatorFn = Callable[[EstimatorInput], np.ndarray]


def _group_centred(x: EstimatorInput) -> np.ndarray:
    out = np.zeros_like(x.rewards)
    for idx in x.groups():
        out[idx] = x.rewards[idx] - x.rewards[idx].mean()
    return out


def _whiten(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(v - mean) / (std + EPS) over the batch, each episode weighted by its trained tokens (the token
    statistics of REINFORCE++'s batch normalisation); equal weights when no episode trains a token."""
    w = weights.astype(np.float64)
    if w.sum() <= 0:
        w = np.ones_like(w)
    mean = float((w * values).sum() / w.sum())
    std = float(np.sqrt((w * (values - mean) ** 2).sum() / w.sum()))
    return (values - mean) / (std + EPS)


def grpo(x: EstimatorInput) -> np.ndarray:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``(r - mean(group)) / (std(group) + EPS)``, std the
    population standard deviation of the group's rewards."""
    out = np.zeros_like(x.rewards)
    for idx in x.groups():
        r = x.rewards[idx]
        out[idx] = (r - r.mean()) / (r.std() + EPS)
    return out.astype(np.float32)


def dr_grpo(x: EstimatorInput) -> np.ndarray:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``r - mean(group)``, no std
    division (which weights easy and hard tasks unequally). Its other half, the constant normaliser, is
    the aggregation ``seq_mean_token_sum_norm`` that ``loss_agg: auto`` picks with it."""
    return _group_centred(x).astype(np.float32)


def rloo(x: EstimatorInput) -> np.ndarray:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): ``r_i - mean(r_j, j != i)`` over the group, which
    is ``k / (k - 1) * (r_i - mean(group))`` for a group of k; 0 for a group of one."""
    out = np.zeros_like(x.rewards)
    for idx in x.groups():
        k = len(idx)
        if k > 1:
            r = x.rewards[idx]
            out[idx] = (r - (r.sum() - r) / (k - 1))
    return out.astype(np.float32)


def reinforce_pp(x: EstimatorInput) -> np.ndarray:
    """REINFORCE++ (Hu 2025): the reward (an outcome reward is each token's return with gamma 1),
    normalised over the whole batch: ``(r - mean) / (std + EPS)``, token-weighted. No group baseline."""
    return _whiten(x.rewards, x.token_counts).astype(np.float32)


def reinforce_pp_baseline(x: EstimatorInput) -> np.ndarray:
    """REINFORCE++-baseline (Hu 2025): ``r - mean(group)``, then normalised over the whole batch
    (token-weighted mean and std), so the scale comes from the batch, not from each group's spread."""
    return _whiten(_group_centred(x), x.token_counts).astype(np.float32)


ESTIMATORS: dict[str, EstimatorFn] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}
GROUP_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"})  # need >= 2 episodes per task


def get_estimator(name: str) -> EstimatorFn:
    """The registered estimator ``name``, or the function a ``package.module:function`` names."""
    return named_callable("algorithm.advantage_estimator", name, ESTIMATORS)


def estimate(name: str, x: EstimatorInput) -> np.ndarray:
    """Run estimator ``name`` on ``x`` and check what it returned (shape [n], finite)."""
    out = np.asarray(get_estimator(name)(x), dtype=np.float32)
    if out.shape != x.rewards.shape:
        raise ValueError(f"advantage estimator {name!r} returned shape {out.shape} for {len(x.rewards)} episodes")
    if not np.all(np.isfinite(out)):
        raise ValueError(f"advantage estimator {name!r} returned a non-finite advantage")
    return out
