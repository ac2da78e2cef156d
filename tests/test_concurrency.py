"""The schedule's groups in flight and episodes per rollout worker (rayrl/concurrency.py)."""

import pytest

from rayrl.concurrency import (
    capacity_warnings,
    episodes_per_worker,
    groups_in_flight,
    with_rollout_concurrency,
)
from rayrl.config import ConfigError, load_config

EXAMPLE = "examples/calculator/config.yaml"


def _cfg(*overrides: str):
    return load_config(EXAMPLE, ["rollout.prompts_per_step=2", "rollout.group_size=4", *overrides])


def test_sync_runs_one_step_of_groups():
    cfg = _cfg("pipeline.schedule=sync", "pipeline.groups_in_flight=10")
    assert groups_in_flight(cfg) == 2
    assert episodes_per_worker(cfg) == 8


@pytest.mark.parametrize("schedule", ["async", "colocated_async"])
def test_async_keeps_staleness_bound_batches_and_threads_for_all_of_them(schedule):
    cfg = _cfg(f"pipeline.schedule={schedule}", "pipeline.max_staleness=2", "rollout.max_concurrent_episodes=0")
    assert groups_in_flight(cfg) == 6  # (2 + 1) batches of 2 groups
    assert episodes_per_worker(cfg) == 24
    split = _cfg(f"pipeline.schedule={schedule}", "pipeline.max_staleness=2", "rollout.num_workers=5")
    assert episodes_per_worker(split) == 5  # ceil(24 / 5): every episode has a thread
    validating = _cfg(f"pipeline.schedule={schedule}", "pipeline.max_staleness=2", "pipeline.eval_interval=2",
                      "pipeline.eval_max_concurrent=8", "data.val_path=examples/calculator/data/val.jsonl")
    assert episodes_per_worker(validating) == 32  # validation's own bound on top


def test_explicit_values_win_and_resolution_is_recorded():
    cfg = _cfg("pipeline.schedule=async", "pipeline.groups_in_flight=3", "rollout.max_concurrent_episodes=7")
    assert groups_in_flight(cfg) == 3
    assert episodes_per_worker(cfg) == 7
    auto = _cfg("pipeline.schedule=async", "pipeline.max_staleness=1")
    resolved = with_rollout_concurrency(auto)
    assert (resolved.pipeline.groups_in_flight, resolved.rollout.max_concurrent_episodes) == (4, 16)
    assert (auto.pipeline.groups_in_flight, auto.rollout.max_concurrent_episodes) == (0, 0)  # caller's untouched


def test_negative_concurrency_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout.max_concurrent_episodes"):
        _cfg("rollout.max_concurrent_episodes=-1")


def test_capacity_warnings_name_the_limit():
    assert capacity_warnings(_cfg("pipeline.schedule=async", "pipeline.max_staleness=2",
                                  "sandbox_pool.max_size=32")) == []
    short = capacity_warnings(_cfg("pipeline.schedule=async", "pipeline.max_staleness=2",
                                   "rollout.max_concurrent_episodes=16", "sandbox_pool.max_size=8",
                                   "sandbox_pool.min_warm=4"))
    assert len(short) == 2
    assert "rollout.max_concurrent_episodes=16" in short[0] and "(24)" in short[0]
    assert short[1].startswith("sandbox_pool.max_size=8 is below the 16 episodes")
