"""driver.py's command line: bad configs and missing models fail fast with a clear message and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_driver(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "driver.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize(
    "args, message",
    [
        (["trainer.stepz=3"], "config error: trainer.stepz"),
        (["rollout.temperature=warm"], "config error: rollout.temperature"),
        (["--config", "/nope.yaml"], "config error: config file not found"),
        (["model.path=/no/such/model"], "model error: model.path: '/no/such/model' is not a model directory"),
        (["trainer.loss=grpo"], "config error: trainer.loss: removed; it selected nothing; write "
                                "algorithm.advantage_estimator"),
        (["algorithm.policy_loss=gspo_typo"], "config error: algorithm.policy_loss: unknown 'gspo_typo'"),
        (["algorithm.kl_loss_coef=0.1", "algorithm.reference_path=/no/ref"],
         "model error: algorithm.reference_path: '/no/ref' is not a model directory"),
        (["algorithm.distill_teacher=/no/teacher"],
         "model error: algorithm.distill_teacher: '/no/teacher' is not a model directory"),
    ],
)
def test_bad_input_exits_2_with_message(args, message):
    out = run_driver(*args)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert "Started a local Ray" not in out.stderr + out.stdout  # failed before starting Ray
