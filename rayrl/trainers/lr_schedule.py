"""The learning rate at each optimizer step: linear warm-up, then constant or cosine decay.

Both backends set it on every parameter group before each optimizer step (Megatron's own
``OptimizerParamScheduler`` does the same to ``param_groups``), from the count of optimizer steps taken
so far, which checkpoints keep. A run makes ``trainer.steps x num_steps_per_rollout x
epochs_per_rollout`` optimizer steps; the cosine reaches ``lr x lr_min_ratio`` at the last of them
(Loshchilov & Hutter 2017, without restarts).
"""

from __future__ import annotations

import math

from rayrl.config import TrainerConfig


def total_optimizer_steps(cfg: TrainerConfig) -> int:
    """Optimizer steps in the whole run."""
    return cfg.steps * cfg.num_steps_per_rollout * cfg.epochs_per_rollout


def lr_at(step: int, cfg: TrainerConfig) -> float:
    """The learning rate of optimizer step ``step`` (0 for the first)."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(total_optimizer_steps(cfg) - cfg.lr_warmup_steps - 1, 1)
    progress = min(max((step - cfg.lr_warmup_steps) / span, 0.0), 1.0)
    floor = cfg.lr_min_ratio
    return cfg.lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def set_lr(optimizer: object, lr: float) -> None:
    """Put ``lr`` on every parameter group of ``optimizer`` (torch or Megatron)."""
    for group in optimizer.param_groups:  # type: ignore[attr-defined]
        group["lr"] = lr
