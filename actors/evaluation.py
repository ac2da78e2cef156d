"""Validation: one episode per held-out task on the current weights, with bounded concurrency.

Validation episodes run on the same rollout workers as training (round-robin), at most
``pipeline.eval_max_concurrent`` at once, and train nothing. The metrics are logged under ``eval/``; like
the training figures (rayrl/rl/step_metrics.py), reward and success rate are over the scored episodes,
infrastructure failures counted apart (``eval/episodes_excluded``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import ray
from tqdm import tqdm

from rayrl.rl.failures import is_scored
from rayrl.rl.step_metrics import reward_breakdown_means
from rayrl.types import Episode, Task


def evaluate(workers: Sequence[Any], tasks: Sequence[Task], max_concurrent: int, step: int) -> dict[str, Any]:
    """Run every task once; returns the ``eval/*`` metrics and prints one summary line."""
    episodes: list[Episode] = []
    in_flight: list[Any] = []
    started = time.monotonic()
    with tqdm(total=len(tasks), desc=f"eval @ step {step}", unit="ep", leave=False, dynamic_ncols=True) as bar:
        for i, task in enumerate(tasks):
            if len(in_flight) >= max_concurrent:
                done, in_flight = ray.wait(in_flight, num_returns=1)
                episodes.append(ray.get(done[0]))
                bar.update(1)
            in_flight.append(workers[i % len(workers)].run_episode.remote(task, f"eval{step}-{i}", 0))
        for ref in in_flight:
            episodes.append(ray.get(ref))
            bar.update(1)
    scored = [e for e in episodes if is_scored(e)]  # infrastructure failures have no reward: counted apart
    metrics: dict[str, Any] = {
        "eval/tool_call_rate": float(np.mean([e.info.get("tool_calls", 0) > 0 for e in scored])) if scored else 0.0,
        "eval/episodes_failed": sum(not e.ok for e in episodes),
        "eval/episodes_excluded": len(episodes) - len(scored),
        "eval/time_s": time.monotonic() - started,
    }
    metrics.update({f"eval/{k}": v for k, v in reward_breakdown_means([e for e in episodes if e.ok]).items()})
    if scored:
        metrics["eval/reward_mean"] = float(np.mean([e.reward for e in scored]))
        metrics["eval/success_rate"] = float(np.mean([e.reward >= 1.0 for e in scored]))
        figures = (f"success {metrics['eval/success_rate']:.3f} | reward {metrics['eval/reward_mean']:.3f} | "
                   f"tool calls {metrics['eval/tool_call_rate']:.2f}")
    else:
        figures = "no scored episode"
    print(f"eval @ step {step}: {figures} | {len(episodes)} tasks, {metrics['eval/episodes_excluded']} excluded "
          "(infrastructure)", flush=True)
    return metrics
