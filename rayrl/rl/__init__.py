"""The RL logic every schedule shares, as plain functions and dataclasses (no Ray, no actors).

``groups.py``: a GRPO group (one task's episodes) and the staleness filter of the async schedules.
``batch.py``: GRPO advantages and the step's training batch built from its episodes.
``shard.py``: how a batch is split over the trainer's data-parallel replicas (Megatron's rank order).
``failures.py``: why an episode failed, and whether the system or the agent is to blame.
``step_metrics.py``: one step's metrics from what the step gathered.

Why here: the pipeline (actors/pipeline.py), the dispatcher and the trainer group are Ray shells that
move data between processes; what they compute (which groups train, with what advantages, on which
rank, and what a step reports) is decided here, once for sync, async and colocated schedules alike,
and tested without starting Ray (tests/test_rl_*.py).
"""

from rayrl.rl.batch import Batch, build_batch, grpo_advantages
from rayrl.rl.failures import failure_kind, is_infra
from rayrl.rl.groups import Group, split_short, split_stale
from rayrl.rl.shard import dp_rank_of, dp_size, rank_shards, replica_leads, shard_batch
from rayrl.rl.step_metrics import EngineWork, step_metrics

__all__ = [
    "Batch",
    "EngineWork",
    "Group",
    "build_batch",
    "dp_rank_of",
    "dp_size",
    "failure_kind",
    "grpo_advantages",
    "is_infra",
    "rank_shards",
    "replica_leads",
    "shard_batch",
    "split_short",
    "split_stale",
    "step_metrics",
]
