"""Reward shaping before the advantages: DAPO's overlong penalty.

DAPO (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning system at scale", section 3.4)
adds a length penalty to the reward of responses that approach the generation limit, so that the
policy learns to stay inside it rather than being cut off at random points::

    penalty(L) = 0                                   when L <= L_max - L_buffer
               = (L_max - L_buffer - L) / L_buffer   when L_max - L_buffer < L <= L_max
               = -1                                  when L > L_max

times ``overlong_penalty``. For an agent, ``L`` is every token the episode generated over all its
turns (``Episode.generated_tokens``), ``L_max`` is ``algorithm.overlong_max_tokens`` and ``L_buffer``
``algorithm.overlong_buffer_tokens``. The penalty changes only what the estimator sees; the episode's
recorded reward (and success rate) stay as the reward function gave them.
"""

from __future__ import annotations

from typing import Sequence

from rayrl.config.algorithm import AlgorithmConfig
from rayrl.types import Episode


def overlong_penalty(length: int, max_tokens: int, buffer_tokens: int, scale: float = 1.0) -> float:
    """DAPO's soft overlong penalty (module docstring) for an episode of ``length`` generated tokens;
    0 when ``max_tokens`` is 0 (off)."""
    if max_tokens <= 0 or length <= max_tokens - buffer_tokens:
        return 0.0
    if length > max_tokens:
        return -scale
    return scale * (max_tokens - buffer_tokens - length) / buffer_tokens


def shaped_rewards(episodes: Sequence[Episode], algo: AlgorithmConfig) -> tuple[list[float], dict[str, float]]:
    """Each episode's reward plus its overlong penalty, and the step's shaping metrics
    (``shaping/overlong_episodes``: episodes penalised, ``shaping/overlong_penalty_mean``)."""
    penalties = [overlong_penalty(e.generated_tokens, algo.overlong_max_tokens, algo.overlong_buffer_tokens,
                                  algo.overlong_penalty) for e in episodes]
    rewards = [e.reward + p for e, p in zip(episodes, penalties)]
    if algo.overlong_max_tokens <= 0:
        return rewards, {}
    hit = [p for p in penalties if p != 0.0]
    return rewards, {"shaping/overlong_episodes": float(len(hit)),
                     "shaping/overlong_penalty_mean": float(sum(penalties) / max(len(penalties), 1))}
