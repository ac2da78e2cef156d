"""What driver.py checks before Ray starts, so a mistake costs a second and one line, not a cluster start.

The schema (types, ranges, choices) is checked by ``load_config``. This adds what needs more than the
YAML: the names the plug-in tables must hold and their traits against the other sections
(rayrl/resolve.py ``check``), every ``package.module:name`` the config names is imported and its signature checked
(``rollout.agent``, ``rollout.reward``, ``trajectory.debug_callback``; rayrl/extensions.py), the
python agent's tools exist, an agent command is there, and the data files are read and their fields
mapped row by row (``file:line`` for the first bad rows). Every failure is a
:class:`~rayrl.config.ConfigError` naming the field; driver.py prints it on one line and exits 2.
"""

from __future__ import annotations

from rayrl.config import ConfigError, DataConfig, RunConfig
from rayrl.resolve import check


def check_data(field: str, path: str, data: DataConfig) -> int:
    """Read and map every row of ``path`` as ``data`` says; returns how many tasks it holds, or raises
    ConfigError naming ``field``."""
    from rayrl.data.dataset import DatasetError, FileDataset

    try:
        return len(FileDataset(path, data.max_prompt_chars, data.fields, data.format))
    except DatasetError as err:
        raise ConfigError(f"{field}: {err}") from None


def preflight(cfg: RunConfig, data: bool = True) -> None:
    """Check everything :mod:`rayrl.preflight` covers (``data=False``: not the data files)."""
    from rayrl.agents import check_agent
    from rayrl.rewards import reward_fn_for
    from rayrl.trajectory.events import load_callback

    check(cfg)
    check_agent(cfg.rollout)
    reward_fn_for(cfg.rollout)
    load_callback(cfg.trajectory.debug_callback)
    if data and cfg.rollout.environment:
        from rayrl.data.load import load_tasks

        load_tasks(cfg)  # the environment loads, its datasets are built (no hub), eval_interval has a set
    elif data and cfg.data.reasoning_gym:
        from rayrl.data.reasoning_gym import check_sources

        check_sources(cfg.data.reasoning_gym)
    elif data:
        check_data("data.train_path", cfg.data.train_path, cfg.data)
    if data:
        if cfg.data.val_path:
            check_data("data.val_path", cfg.data.val_path, cfg.data)
