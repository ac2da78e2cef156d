"""The RL logic every schedule shares, as plain functions and dataclasses (no Ray, no actors).

``groups.py``: a group (one task's episodes) and the filters of the schedules (stale, short, equal rewards).
``advantages.py``: the advantage estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++...), by name.
``shaping.py``: reward shaping before the estimator (DAPO's overlong penalty).
``batch.py``: the step's training batch built from its episodes.
``distill.py``: on-policy distillation: a teacher engine's log-probs of the student's samples.
``updates.py``: which samples train and how a batch splits into optimizer steps over the ranks.
``staleness.py``: how old each trained token is.
``shard.py``: how a batch is split over the trainer's data-parallel replicas (Megatron's rank order).
``failures.py``: why an episode failed, and whether the system or the agent is to blame.
``step_metrics.py``: one step's metrics from what the step gathered.
``guards.py``: the silent-failure guards, one record each, measured every step (docs/guards.md).

Why here: the pipeline (actors/pipeline.py), the dispatcher and the trainer group are Ray shells that
move data between processes; what they compute (which groups train, with what advantages, on which
rank, and what a step reports) is decided here, once for sync, async and colocated schedules alike,
and tested without starting Ray (tests/test_rl_*.py).
"""

from rayrl.rl.advantages import ESTIMATORS, EstimatorInput, estimate
from rayrl.rl.batch import Batch, build_batch
from rayrl.rl.failures import failure_kind, is_infra
from rayrl.rl.groups import Group, split_short, split_stale
from rayrl.rl.shard import dp_rank_of, dp_size, rank_shards, replica_leads, shard_batch
from rayrl.rl.step_metrics import EngineWork, step_metrics

__all__ = [
    "ESTIMATORS",
    "Batch",
    "EngineWork",
    "EstimatorInput",
    "Group",
    "build_batch",
    "dp_rank_of",
    "dp_size",
    "estimate",
    "failure_kind",
    "is_infra",
    "rank_shards",
    "replica_leads",
    "shard_batch",
    "split_short",
    "split_stale",
    "step_metrics",
]
