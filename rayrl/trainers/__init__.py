"""Trainer backends (torch; megatron on GPU), the one loss helper they share (objective.py), the policy
losses (policy_losses.py), the learning-rate schedule and memory saving."""

from rayrl.trainers.objective import Objective, TokenBatch
from rayrl.trainers.policy_losses import POLICY_LOSSES, get_policy_loss

__all__ = ["POLICY_LOSSES", "Objective", "TokenBatch", "get_policy_loss"]
