"""The run's training and held-out tasks from ``data``: the user's data files (rayrl/data/dataset.py: any format of
rayrl/data/formats.py, fields mapped by ``data.fields``), an environment's datasets, or reasoning-gym's generators."""

from __future__ import annotations

from rayrl.config import ConfigError, RunConfig
from rayrl.data.dataset import FileDataset, TaskSource


def load_tasks(cfg: RunConfig) -> tuple[TaskSource, TaskSource | None]:
    """``(training tasks, held-out tasks or None)``: ``rollout.environment``'s datasets when it is set;
    ``data.reasoning_gym`` when it names datasets (a held-out set when an entry has ``val_size``, else
    ``data.val_path`` if set); else ``data.train_path`` and ``data.val_path``."""
    data = cfg.data
    val: TaskSource | None = None
    if cfg.rollout.environment:
        from rayrl.environments import kind_module

        module, target = kind_module(cfg.rollout.environment)
        train, val = module.load_splits(target, dict(cfg.rollout.environment_args))
        if cfg.pipeline.eval_interval and val is None:
            raise ConfigError(f"pipeline.eval_interval: {cfg.rollout.environment} has no eval dataset to validate on")
        return train, val
    if data.reasoning_gym:
        from rayrl.data.reasoning_gym import load_splits

        train, val = load_splits(data.reasoning_gym)
    else:
        train = FileDataset(data.train_path, data.max_prompt_chars, data.fields, data.format)
    if val is None and data.val_path:
        val = FileDataset(data.val_path, data.max_prompt_chars, data.fields, data.format)
    return train, val
