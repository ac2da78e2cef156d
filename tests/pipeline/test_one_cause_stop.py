"""Issue 43's run, for real: every episode fails the same way, and the run stops after its first step.

The agent is a program written with the Anthropic SDK 2.x that passes ``temperature`` as a keyword
(tests/anthropic_agent.py --as-keyword): TypeError before any request, in every episode. The user's own
JSONL (question/answer, mapped by data.fields). driver.py runs as a real subprocess with its own local Ray
on the tiny random model. Before: 16 tracebacks a step, nothing trained, a checkpoint, exit 0. Now: the
traceback once with its count, the one_cause_failures guard's one line (the cause, an example episode),
a checkpoint, exit code 4, step 2 never starts. The fast twins: tests/rl/test_failure_log.py (the log and the
guard on hand-built steps), tests/pipeline/test_dry_run.py (the same agent in a dry run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~1 min: a real driver run (make test-slow)
def test_a_step_where_every_episode_failed_alike_stops_the_run(tiny_model_dir, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(8)))
    run_dir = tmp_path / "runs" / "one-cause"
    args = [
        "--config", str(ROOT / "examples" / "unit_convert" / "config.yaml"),
        f"model.path={tiny_model_dir}", "exp_id=one-cause", f"logging.output_dir={tmp_path / 'runs'}",
        f"data.train_path={data}", "data.val_path=null", "data.fields.prompt=question", "data.fields.answer=answer",
        "rollout.agent=command", "rollout.agent_command=[python,tests/anthropic_agent.py,--as-keyword]",
        "rollout.reward=math", "rollout.prompts_per_step=2", "rollout.group_size=2", "trainer.steps=3",
        "engine.dtype=float32", "pipeline.eval_interval=0", "logging.tensorboard=false", "logging.plot=false",
        "ray.include_dashboard=false", "ray.num_cpus=4",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "driver.py"), *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 4, out[-4000:]
    assert out.count("Traceback (most recent call last)") == 1, out[-4000:]  # once, with its count
    assert "step 1: 4 episodes failed (agent_crashed; scored 0) e.g. session=" in out
    guard = next(line for line in out.splitlines() if line.startswith("[rayrl] guard one_cause_failures"))
    assert guard.startswith("[rayrl] guard one_cause_failures at step 1: 1.00 of 4 episodes failed for one cause "
                            "(agent_crashed: TypeError: ")
    assert "'temperature'" in guard and "e.g. episode s" in guard and "stopping the run" in guard
    assert "step 1/3 |" in out and "step 2/3 |" not in out
    assert "Checkpoint: " in next(line for line in out.splitlines() if line.startswith("[rayrl] run stopped by guard"))
    assert (run_dir / "checkpoints").exists()
    rows = [json.loads(line) for line in (run_dir / "episodes" / "step000001.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["failure"] == "agent_crashed" and "Traceback" in r["error"] for r in rows)
