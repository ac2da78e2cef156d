"""A guard set to stop stops the real run cleanly: its line, a checkpoint, exit code 4, a resume that works.

driver.py runs as a real subprocess with its own local Ray on the tiny random model, whose rambling every
8-token limit cuts: with ``guards.truncation: stop`` (its default threshold, 0.5) the guard fires in step 1.
The run must print the guard's line and the stop line with the
resume command, leave the step-1 checkpoint and guards.jsonl, and exit 4; the printed command, with the
guard set to warn, resumes from that checkpoint and finishes. The fast twins: tests/rl/test_guards.py
(stop, warn, off on hand-built steps), tests/gateway/test_guards_gateway.py (each failure planted in real
episodes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _driver(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(ROOT / "driver.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow  # ~2 min: two real driver runs (make test-slow)
def test_a_stop_guard_checkpoints_exits_4_and_the_printed_resume_works(tiny_model_dir, tmp_path):
    data = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t-{i}", "prompt": f"What is {i} + 1?", "metadata": {"question": f"What is {i} + 1?",
             "answer": i + 1}} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "runs" / "guarded"
    args = [
        "--config", str(ROOT / "examples" / "calculator" / "config.yaml"),
        f"model.path={tiny_model_dir}", "exp_id=guarded", f"logging.output_dir={tmp_path / 'runs'}",
        f"data.train_path={data}", "data.val_path=null", "data.shuffle=false", "engine.dtype=float32",
        "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_tokens=8", "rollout.max_turns=1",
        "rollout.few_shot_examples=0", "trainer.steps=2", "sandbox_pool.min_warm=1", "logging.tensorboard=false",
        "logging.plot=false", "pipeline.checkpoint_interval=0", "ray.include_dashboard=false", "ray.num_cpus=4",
        "guards.truncation=stop",
    ]
    first = _driver(args)
    out = first.stdout + first.stderr
    assert first.returncode == 4, out[-4000:]
    assert "[rayrl] guard truncation at step 1: 1.00 of 8 scored episodes were cut by max_tokens" in out
    assert "step 1/2 |" in out and "| guards: truncation" in out and "step 2/2 |" not in out
    stop_line = next(line for line in out.splitlines() if line.startswith("[rayrl] run stopped by guard"))
    assert "Checkpoint: " in stop_line and (run_dir / "checkpoints").exists()
    resume = stop_line.split("Resume with: ")[1].split(" (add")[0]
    assert resume == f"python driver.py --config {run_dir / 'config.yaml'} --resume"
    (crossing,) = [json.loads(line) for line in (run_dir / "guards.jsonl").read_text().splitlines()]
    assert crossing["guard"] == "truncation" and crossing["action"] == "stop" and crossing["index"] is not None
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["guards/truncated_rate"] == 1.0 and metrics[-1]["guards/fired"] >= 1

    second = _driver(["--config", str(run_dir / "config.yaml"), "--resume", "guards.truncation=warn"])
    out2 = second.stdout + second.stderr
    assert second.returncode == 0, out2[-4000:]
    assert "step 2/2 |" in out2 and "step 1/2 |" not in out2  # resumed after the stopped step
    assert "[rayrl] guard truncation at step 2" in out2  # still measured, now a warning
