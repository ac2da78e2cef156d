"""One step's metrics (rayrl/rl/step_metrics.py) on hand-built episodes: every key the pipeline logs,
with hand-computed values, and how a failed episode's kind is named."""

from __future__ import annotations

import numpy as np
import pytest

from rayrl.rl.batch import build_batch
from rayrl.rl.failures import failure_kind
from rayrl.rl.step_metrics import EngineWork, gateway_metrics, step_metrics
from rayrl.types import Episode, Sample


def _sample(versions: list[int]) -> Sample:
    n = len(versions)
    return Sample(tokens=np.arange(2 + n), prompt_length=2, loss_mask=[1] * n, rollout_logprobs=np.zeros(n),
                  policy_versions=versions)


def _episodes() -> list[Episode]:
    info = {"turns": 2, "tool_calls": 3, "tool_errors": 1}
    return [
        Episode("s0", "t", "g", [_sample([4, 4, 4])], reward=1.0, info=info),
        Episode("s1", "t", "g", [_sample([3]), _sample([4, 4])], reward=0.0,
                info={"turns": 4, "tool_calls": 1, "tool_errors": 0}),
        Episode("s2", "t", "g", [_sample([4])], reward=0.0, status="failed", failure="sandbox_failed",
                error="sandbox_failed: lease timed out", info={"turns": 9}),  # infrastructure: not trained
    ]


def _engines(**kw) -> EngineWork:
    base = dict(prompt_tokens=400, cached_prompt_tokens=100, busy_s={"prefill_s": 2.0, "decode_s": 6.0},
                window_s=10.0, engines=2)
    return EngineWork(**{**base, **kw})


def _metrics(**kw) -> dict:
    episodes = _episodes()
    args = dict(version=5, policy_version=6, train={"train/loss": 0.25, "train/trained_samples": 3,
                                                    "train/policy_version": 6, "time/train_s": 1.5},
                pipeline_counts={"dropped_stale_groups": 1}, groups_in_flight=7,
                failures={"sandbox_failed": 2, "episodes_requeued": 1}, engines=_engines(),
                extra={"gateway/requests": 12.0, "agentcore/invocations": 3}, rollout_s=4.0, step_s=8.0,
                run_episodes=30, run_s=60.0)
    return step_metrics(episodes, build_batch(episodes), **{**args, **kw})


def test_every_metric_by_hand():
    m = _metrics()
    assert m == {
        "rollout/reward_mean": 0.5,  # over the two scored episodes: the infrastructure failure has no reward
        "rollout/success_rate": 0.5,
        "rollout/episodes": 3,
        "rollout/episodes_scored": 2,
        "rollout/excluded_sandbox_failed": 1,
        "rollout/episodes_ok": 2,
        "rollout/episodes_failed": 1,
        "rollout/episodes_excluded": 1,  # the infrastructure failure
        "rollout/samples": 3,
        "rollout/generated_tokens": 7,  # trained tokens of every episode, the failed one's too
        "rollout/turns_mean": 3.0,  # successful episodes only
        "rollout/tool_calls_mean": 2.0,
        "rollout/tool_errors_mean": 0.5,
        "pipeline/staleness_mean": pytest.approx(4 / 3),  # samples oldest 4, 3, 4 against version 5
        "pipeline/staleness_max": 2,
        "pipeline/stale_token_fraction": 1.0,  # every trained token (versions 4, 4, 4, 3, 4, 4) is older than 5
        "pipeline/groups_in_flight": 7,
        "time/rollout_s": 4.0,
        "pipeline/dropped_stale_groups": 1,
        "train/loss": 0.25,
        "train/trained_samples": 3,
        "train/policy_version": 6,
        "time/train_s": 1.5,
        "gateway/requests": 12.0,
        "agentcore/invocations": 3,
        "engine/prompt_tokens": 400,
        "engine/prefix_cache_hit_rate": 0.25,
        "failures/sandbox_failed": 2,
        "failures/episodes_requeued": 1,
        "time/step_s": 8.0,
        "engine/prefill_s": 1.0,  # per engine
        "engine/decode_s": 3.0,
        "engine/busy_fraction": 0.4,  # 8 s over 2 engines in a 10 s window
        "rollout/episodes_per_s": 3 / 8,
        "rollout/generated_tokens_per_s": 7 / 8,
        "rollout/episodes_per_s_run": 0.5,
    }
    assert isinstance(m["rollout/reward_mean"], float) and isinstance(m["rollout/turns_mean"], float)


def test_no_gradient_step_and_empty_step():
    m = _metrics(train=None, policy_version=5)
    assert m["train/trained_samples"] == 0 and m["train/policy_version"] == 5 and "train/loss" not in m
    empty = step_metrics([], build_batch([]), version=0, policy_version=0, train=None, pipeline_counts={},
                         groups_in_flight=0, failures={},
                         engines=_engines(prompt_tokens=0, cached_prompt_tokens=0, busy_s={}, window_s=0.0,
                                          engines=0),
                         extra={}, rollout_s=0.0, step_s=0.0, run_episodes=0, run_s=0.0)
    assert "rollout/reward_mean" not in empty and "rollout/success_rate" not in empty  # nothing was scored
    assert empty["rollout/turns_mean"] == 0.0 and empty["rollout/episodes_excluded"] == 0
    assert empty["pipeline/staleness_mean"] == 0.0 and empty["pipeline/staleness_max"] == 0
    assert empty["engine/prefix_cache_hit_rate"] == 0.0 and empty["engine/busy_fraction"] == 0.0
    assert empty["rollout/episodes_per_s"] == 0.0 and empty["rollout/episodes_per_s_run"] == 0.0


def test_failure_kind():
    def failed(error):
        return Episode("s", "t", "g", status="failed", error=error)

    assert failure_kind(failed("sandbox: lease timed out after 30 s")) == "sandbox"
    assert failure_kind(failed("rollout worker died 3 times: RayActorError")) == "rollout worker died 3 times"
    assert failure_kind(failed("step deadline reached")) == "step deadline reached"
    assert failure_kind(failed(None)) == "unknown" and failure_kind(failed("")) == "unknown"
    assert failure_kind(failed("x" * 100 + ": detail")) == "x" * 60


def _timed_out(session: str, group: str) -> Episode:
    return Episode(session, "t", group, [_sample([4])], reward=0.0, status="failed", failure="timed_out",
                   error="timed_out: the episode ran past rollout.episode_timeout_s")


def test_excluded_episodes_count_apart_and_the_agents_own_failures_count_in():
    """Issue 43: one hang made step 1 read 0.5. A timed-out episode is neither a reward of 0 nor trained; an
    agent that crashed by its own doing is scored 0 and trains, so it is in the figures."""
    crashed = Episode("s3", "t", "g2", [_sample([4])], reward=0.0, status="failed", failure="agent_crashed",
                      error="agent_crashed: TypeError: create() got an unexpected keyword argument 'temperature'")
    episodes = [Episode("s0", "t", "g", [_sample([4])], reward=1.0, info={"turns": 1, "tool_calls": 2}),
                _timed_out("s1", "g"), _timed_out("s2", "g"), crashed,
                Episode("s4", "t", "g2", [_sample([4])], reward=1.0, info={"turns": 1, "tool_calls": 0})]
    batch = build_batch(episodes)
    m = step_metrics(episodes, batch, version=4, policy_version=4, train=None, pipeline_counts={},
                     groups_in_flight=0, failures={}, engines=_engines(), extra={}, rollout_s=1.0, step_s=1.0,
                     run_episodes=5, run_s=1.0)
    assert m["rollout/reward_mean"] == pytest.approx(2 / 3) and m["rollout/success_rate"] == pytest.approx(2 / 3)
    assert m["rollout/episodes_scored"] == 3 == len(batch.samples)  # exactly the episodes that train
    assert m["rollout/episodes_excluded"] == 2 and m["rollout/excluded_timed_out"] == 2
    assert "rollout/excluded_agent_crashed" not in m
    assert m["rollout/tool_calls_mean"] == 1.0  # over the completed episodes
    only_hangs = [_timed_out("s1", "g"), _timed_out("s2", "g")]
    m = step_metrics(only_hangs, build_batch(only_hangs), version=4, policy_version=4, train=None,
                     pipeline_counts={}, groups_in_flight=0, failures={}, engines=_engines(), extra={},
                     rollout_s=1.0, step_s=1.0, run_episodes=2, run_s=1.0)
    assert "rollout/reward_mean" not in m and m["rollout/excluded_timed_out"] == 2


def test_gateway_metrics_sum_counters_and_take_the_slowest_shards_record_time():
    shard = lambda requests, p50, p99: {"requests": requests, "open_sessions": 3,  # noqa: E731
                                        "durations": {"record_turn": {"count": 9, "p50_ms": p50, "p99_ms": p99},
                                                      "finish_session": {"p99_ms": 50.0}}}
    out = gateway_metrics([shard(5, 0.2, 1.5), shard(7, 0.3, 0.9)])
    assert out["gateway/requests"] == 12
    assert out["trajectory/record_turn_p50_ms"] == 0.3 and out["trajectory/record_turn_p99_ms"] == 1.5
    assert "trajectory/record_turn_p99_ms" not in gateway_metrics([{"requests": 1}])  # an older shard's stats
