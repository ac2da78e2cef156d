"""Trainer backends (torch; megatron on GPU), losses and weight export."""

from rayrl.trainers.losses import grpo_advantages, ppo_clip_token_loss

__all__ = ["grpo_advantages", "ppo_clip_token_loss"]
