"""One training step's metrics, from plain inputs: what every schedule logs after a step.

The names are the run's public record (metrics.jsonl, tensorboard, the Ray dashboard, docs/operations.md)
and tests and benches read them, so they change only on purpose. Everything here is arithmetic over
values the pipeline has already gathered (episodes, the batch, the train phase's figures, the engines'
counters); nothing is read from actors, so a step's numbers can be checked on hand-built episodes.

Conventions: reward and success rate are over the step's scored episodes (rayrl/rl/failures.py
``is_scored``: completed, or failed by the agent's or the reward's own doing, with the reward it was
given), the episodes whose rewards train; an infrastructure failure (timed out, sandbox, engine, ...) has
no reward that says anything about the policy, so it is left out of them and counted apart:
``rollout/episodes_excluded`` and ``rollout/excluded_<kind>`` per step. A step without a scored episode
has no ``rollout/reward_mean`` or ``rollout/success_rate`` (the reward curve skips it; 0 would be a
figure nobody earned). Episodes of groups dynamic sampling dropped (all rewards equal) are scored and
count. An episode succeeds when its reward is at least 1.0; turn and tool means are over the completed
ones only, and ``tool_calls`` is what the gateway recorded (rayrl/agents/episode.py), for every kind of
agent; rates divide by at least 1e-9 s; engine figures are per engine.

Per step or running total: everything is about the step (its episodes, its batch, its train phase, its
time) except the counters that only grow since the run started: ``failures/<kind>`` (failed episodes
and other faults by cause, the step's included), ``gateway/*`` and ``trajectory/*``
(:func:`gateway_metrics`), ``engine/prompt_tokens``, ``train/policy_version`` and
``rollout/episodes_per_s_run``. docs/operations.md has the table.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from rayrl.rl.batch import Batch
from rayrl.rl.failures import failure_kind, is_scored
from rayrl.rl.staleness import token_staleness
from rayrl.types import Episode


@dataclass(frozen=True)
class EngineWork:
    """What the engines report for one step.

    ``prompt_tokens`` and ``cached_prompt_tokens`` are cumulative since the engines started (summed over
    engines); ``busy_s`` is busy seconds by kind (``prefill_s`` and ``decode_s`` forward passes,
    ``weight_pack_s`` rebuilding packed weights after updates) summed over engines since the previous
    reading, which was ``window_s`` seconds ago; ``engines`` is how many there are.
    """

    prompt_tokens: int
    cached_prompt_tokens: int
    busy_s: Mapping[str, float]
    window_s: float
    engines: int


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def step_metrics(
    episodes: Sequence[Episode],
    batch: Batch,
    *,
    version: int,
    policy_version: int,
    train: Mapping[str, Any] | None,
    pipeline_counts: Mapping[str, int],
    groups_in_flight: int,
    failures: Mapping[str, int],
    engines: EngineWork,
    extra: Mapping[str, Any],
    rollout_s: float,
    step_s: float,
    run_episodes: int,
    run_s: float,
) -> dict[str, Any]:
    """The metrics of one step.

    ``episodes``: every episode the step took (failed ones too), ``batch`` built from them.
    ``version``: the policy version the batch trains against (staleness is measured from it);
    ``policy_version``: the version after the step. ``train``: what the train phase reported, already
    named (``train/*``, ``time/train_s``, ...), or None when the step had nothing to learn (then
    ``train/trained_samples`` is 0). ``pipeline_counts``: the step's schedule counts (dropped stale
    groups and samples), logged as ``pipeline/<name>``. ``groups_in_flight``: groups queued, running or
    done but not taken. ``failures``: failure counts by kind since the run started (running totals),
    logged as ``failures/<kind>``.
    ``extra``: metrics gathered elsewhere and already named (``gateway/*``, ``trajectory/*``,
    ``agentcore/*``), logged as given. ``rollout_s``: from the step's start until its groups were taken;
    ``step_s``: the whole step; ``run_episodes`` and ``run_s``: episodes and seconds since the run
    started, this step included.
    """
    ok = [e for e in episodes if e.ok]
    scored = [e for e in episodes if is_scored(e)]
    excluded = Counter(failure_kind(e) for e in episodes if not is_scored(e))
    generated = sum(e.generated_tokens for e in episodes)
    staleness = batch.staleness(version)
    token_ages = token_staleness(batch.samples, version)
    metrics: dict[str, Any] = {
        "rollout/episodes": len(episodes),
        "rollout/episodes_scored": len(scored),
        "rollout/episodes_ok": batch.episodes_ok,
        "rollout/episodes_failed": batch.episodes_failed,
        "rollout/episodes_excluded": sum(excluded.values()),
        "rollout/samples": len(batch.samples),
        "rollout/generated_tokens": generated,
        "rollout/turns_mean": _mean([e.info.get("turns", 0) for e in ok]),
        "rollout/tool_calls_mean": _mean([e.info.get("tool_calls", 0) for e in ok]),
        "rollout/tool_errors_mean": _mean([e.info.get("tool_errors", 0) for e in ok]),
        "pipeline/staleness_mean": _mean(staleness),
        "pipeline/staleness_max": max(staleness, default=0),
        "pipeline/stale_token_fraction": float((token_ages > 0).mean()) if len(token_ages) else 0.0,
        "pipeline/groups_in_flight": groups_in_flight,
        "time/rollout_s": rollout_s,
    }
    if scored:
        metrics["rollout/reward_mean"] = _mean([e.reward for e in scored])
        metrics["rollout/success_rate"] = _mean([e.reward >= 1.0 for e in scored])
    metrics.update({f"rollout/excluded_{kind}": n for kind, n in sorted(excluded.items())})
    metrics.update(reward_breakdown_means(ok))
    metrics.update(judge_metrics(episodes))
    metrics.update({f"pipeline/{k}": v for k, v in pipeline_counts.items()})
    metrics.update(batch.metrics)  # what building the batch measured: reward shaping, distillation
    metrics.update(train if train is not None else {"train/trained_samples": 0})
    metrics["train/policy_version"] = policy_version
    metrics.update(extra)
    metrics["engine/prompt_tokens"] = int(engines.prompt_tokens)
    metrics["engine/prefix_cache_hit_rate"] = engines.cached_prompt_tokens / max(engines.prompt_tokens, 1)
    metrics.update({f"failures/{kind}": n for kind, n in failures.items()})
    metrics["time/step_s"] = step_s
    count = max(engines.engines, 1)
    for kind, seconds in engines.busy_s.items():  # forward-pass time per engine: how busy they were
        metrics[f"engine/{kind}"] = seconds / count
    metrics["engine/busy_fraction"] = sum(engines.busy_s.values()) / count / max(engines.window_s, 1e-9)
    metrics["rollout/episodes_per_s"] = len(episodes) / max(step_s, 1e-9)
    metrics["rollout/generated_tokens_per_s"] = generated / max(step_s, 1e-9)
    metrics["rollout/episodes_per_s_run"] = run_episodes / max(run_s, 1e-9)
    return metrics


def reward_breakdown_means(episodes: Sequence[Any]) -> dict[str, float]:
    """``reward/<name>``: each reward function's mean score over the episodes that report it (an
    environment's rubric functions: ``Episode.info["reward_breakdown"]``)."""
    scores: dict[str, list[float]] = {}
    for e in episodes:
        for name, value in (e.info.get("reward_breakdown") or {}).items():
            scores.setdefault(str(name), []).append(float(value))
    return {f"reward/{name}": _mean(values) for name, values in sorted(scores.items())}


def judge_metrics(episodes: Sequence[Any]) -> dict[str, float]:
    """``judge/*``: the judge calls the step's episodes made (rayrl/rewards/judge.py), failed episodes too:
    how many, how many gave no answer, their tokens, latency and retries. Empty without a judge."""
    calls = [c for e in episodes for c in e.info.get("judge_calls") or ()]
    if not calls:
        return {}
    ok = [c for c in calls if c.get("ok")]
    return {"judge/calls": len(calls), "judge/failed_calls": len(calls) - len(ok),
            "judge/prompt_tokens": sum(c.get("prompt_tokens", 0) for c in ok),
            "judge/completion_tokens": sum(c.get("completion_tokens", 0) for c in ok),
            "judge/latency_s_mean": _mean([c.get("latency_s", 0.0) for c in ok]),
            "judge/latency_s_max": max((c.get("latency_s", 0.0) for c in ok), default=0.0),
            "judge/queue_s_mean": _mean([c.get("queue_s", 0.0) for c in calls]),
            "judge/attempts_mean": _mean([c.get("attempts", 1) for c in calls])}


GATEWAY_TOTALS = ("requests", "errors_4xx", "errors_engine", "tool_parse_errors", "cumulative_hits", "full_renders",
                  "turns", "forks", "merged_rewrites")
ROUTER_TOTALS = ("queued", "continued", "wait_timeouts", "retried", "reconnect_waits", "lost_continued",
                 "engine_waits")


def gateway_metrics(shard_stats: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Gateway, router and trajectory totals summed over the gateway shards (cumulative since
    the run started): ``gateway/<counter>`` (router counters without their ``router_`` prefix: calls held
    while generation was paused, continued after an abort or a lost engine, timed out, retried) and
    ``trajectory/drift_<kind>``; ``trajectory/record_turn_p50_ms``/``_p99_ms``, the slowest shard's."""
    totals: dict[str, float] = {}
    for shard in shard_stats:
        for key, value in shard.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                totals[key] = totals.get(key, 0.0) + value
    out = {f"gateway/{k}": totals[k] for k in GATEWAY_TOTALS if k in totals}
    out.update({f"gateway/{k}": totals[f"router_{k}"] for k in ROUTER_TOTALS if f"router_{k}" in totals})
    out.update({f"trajectory/{k}": v for k, v in totals.items() if k.startswith("drift_")})
    # the manager's own time per recorded turn (rayrl/gateway/durations.py), since the run started: the
    # slowest shard's percentiles, since percentiles do not add up
    for key in ("p50_ms", "p99_ms"):
        values = [s["durations"]["record_turn"][key] for s in shard_stats
                  if isinstance(s.get("durations"), Mapping) and "record_turn" in s["durations"]]
        if values:
            out[f"trajectory/record_turn_{key}"] = float(max(values))
    return out
