"""The RL logic every schedule shares, as plain functions and dataclasses (no Ray, no actors).

``groups.py``: a group (one task's episodes) and the filters of the schedules (stale, short, equal rewards).
``advantages.py``: the advantage estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++...), one table of rows with traits.
``shaping.py``: reward shaping before the estimator (DAPO's overlong penalty).
``batch.py``: the step's training batch built from its episodes.
``distill.py``: on-policy distillation: a teacher engine's log-probs of the student's samples.
``policy_losses.py``: the policy losses (PPO-clip, GSPO, CISPO, SFT...), one table of rows with traits,
and the KL estimators and the entropy.
``objective.py``: the one loss helper both trainer backends call per micro-batch (TIS, KL, entropy, SFT
terms, the aggregation's global normalisers); rayrl/trainers keeps how it is optimised.
``updates.py``: which samples train and how a batch splits into optimizer steps over the ranks (the update
plan: the trainer group makes it, the objective and the backends follow it).
``staleness.py``: how old each trained token is.
``shard.py``: how a batch is split over the trainer's data-parallel replicas (Megatron's rank order).
``failures.py``: why an episode failed, and whether the system or the agent is to blame.
``step_metrics.py``: one step's metrics from what the step gathered.
``guards.py``: the silent-failure guards, one record each, measured every step (docs/guards.md).

Why here: the pipeline (actors/pipeline.py), the dispatcher and the trainer group are Ray shells that
move data between processes; what they compute (which groups train, with what advantages, on which
rank, and what a step reports) is decided here, once for sync, async and colocated schedules alike,
and tested without starting Ray (tests/rl/).

This package face imports none of its modules: an agent that imports ``rayrl.rl.failures`` should not load
the batch builder, whose sample selection reads the policy losses' table (and so imports torch).
"""
