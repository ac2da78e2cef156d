"""Where a run's files go: relative output paths made absolute on the driver's node, once, before Ray starts.

``logging.output_dir`` (and a relative ``pipeline.checkpoint_dir``) is anchored at the directory the
driver runs in, which is where ``python driver.py`` was started. One exception: under
``ray job submit --working-dir DIR`` the driver runs inside Ray's temporary copy of DIR
(``<ray temp>/session_*/runtime_resources/working_dir_files/_ray_pkg_<hash>/``), which Ray deletes once no
job uses it, and which nobody would think of looking in. There, relative outputs are anchored at the
home directory of the user the cluster runs as: ``runs`` becomes ``~/runs``. An absolute path (a shared
filesystem, say) is kept as it is. The driver prints the result (``[rayrl] run directory: ...``).

Inputs (``data.*``, ``rollout.agent_command``) stay relative to the driver's directory: under a job that is
the copy of DIR, where they are.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rayrl.config.schema import RunConfig

RAY_WORKING_DIR_COPY = os.sep + os.path.join("runtime_resources", "working_dir_files") + os.sep


def in_ray_working_dir_copy(cwd: str | os.PathLike) -> bool:
    """Whether ``cwd`` is inside Ray's temporary copy of a job's ``working_dir``."""
    return RAY_WORKING_DIR_COPY in os.path.join(os.path.abspath(cwd), "")


def output_base(cwd: str | os.PathLike | None = None, home: str | os.PathLike | None = None) -> Path:
    """The directory relative output paths are anchored at (see the module docstring)."""
    cwd = Path(cwd or os.getcwd()).absolute()
    if in_ray_working_dir_copy(cwd):
        return Path(home or Path.home()).absolute()
    return cwd


def absolute_outputs(cfg: RunConfig, cwd: str | os.PathLike | None = None,
                     home: str | os.PathLike | None = None) -> RunConfig:
    """``cfg`` with ``logging.output_dir`` and a local ``pipeline.checkpoint_dir`` made absolute."""
    base = output_base(cwd, home)
    output_dir = str(base / Path(cfg.logging.output_dir).expanduser())
    logging_cfg = dataclasses.replace(cfg.logging, output_dir=output_dir)
    pipeline = cfg.pipeline
    location = pipeline.checkpoint_dir
    if location and "://" not in location:
        pipeline = dataclasses.replace(pipeline, checkpoint_dir=str(base / Path(location).expanduser()))
    return dataclasses.replace(cfg, logging=logging_cfg, pipeline=pipeline)
