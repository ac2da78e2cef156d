"""Where a run's files go (rayrl/config/paths.py): absolute, on the driver's node, printed before Ray starts.

Under ``ray job submit --working-dir`` the driver runs in Ray's temporary copy of the working dir, which
Ray deletes after the job: relative outputs go to the home directory there instead. The end-to-end check
with a real head node and the real ``ray job submit`` is tests/pipeline/test_ray_job_submit.py (slow).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rayrl.config import load_config
from rayrl.config.paths import absolute_outputs, in_ray_working_dir_copy, output_base

ROOT = Path(__file__).resolve().parents[2]
COPY = "ray/session_2026-11-26_10-00-00_000000_1/runtime_resources/working_dir_files/_ray_pkg_0123abcd"


def test_relative_outputs_are_anchored_where_the_driver_runs(tmp_path):
    cfg = absolute_outputs(load_config(None, ["exp_id=e1", "pipeline.checkpoint_dir=ckpt"]), cwd=tmp_path,
                           home=tmp_path / "home")
    assert cfg.run_dir == tmp_path / "runs" / "e1" and cfg.run_dir.is_absolute()
    assert cfg.pipeline.checkpoint_dir == str(tmp_path / "ckpt")
    assert output_base(tmp_path, tmp_path / "home") == tmp_path


def test_inside_a_ray_job_working_dir_copy_they_go_to_the_home_directory(tmp_path):
    copy = tmp_path / COPY
    assert in_ray_working_dir_copy(copy) and in_ray_working_dir_copy(copy / "sub")
    assert not in_ray_working_dir_copy(tmp_path / "runtime_resources")
    cfg = absolute_outputs(load_config(None, ["exp_id=e2"]), cwd=copy, home=tmp_path / "home")
    assert cfg.run_dir == tmp_path / "home" / "runs" / "e2"


def test_absolute_and_remote_locations_are_kept(tmp_path):
    cfg = absolute_outputs(load_config(None, [f"logging.output_dir={tmp_path / 'shared'}",
                                              "pipeline.checkpoint_dir=s3://bucket/prefix"]), cwd=tmp_path / COPY)
    assert cfg.logging.output_dir == str(tmp_path / "shared") and cfg.pipeline.checkpoint_dir == "s3://bucket/prefix"


def test_the_driver_prints_the_absolute_run_directory_before_ray_starts(tmp_path):
    """driver.py run from a directory laid out like Ray's working-dir copy, as `ray job submit` runs it."""
    copy = tmp_path / COPY
    copy.mkdir(parents=True)
    for name in ("driver.py", "examples", "rayrl", "actors"):
        (copy / name).symlink_to(ROOT / name)
    home = tmp_path / "home"
    out = subprocess.run([sys.executable, "driver.py", "model.path=/no/such/model"], cwd=copy, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and "model error" in out.stderr  # stops before Ray: no model
    assert f"[rayrl] run directory: {home / 'runs' / 'calculator'}\n" in out.stdout, out.stdout
