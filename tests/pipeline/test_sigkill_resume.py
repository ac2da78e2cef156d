"""A run killed with SIGKILL mid-step resumes from its S3 checkpoint: no task trained twice, none skipped.

driver.py runs as a real subprocess with its own local Ray; checkpoints go to a moto S3 server process
(``pipeline.checkpoint_dir=s3://...``). The test kills the driver while step 3 is running, starts it again
with ``--resume``, and checks the task ids of every trained step against the data order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _driver(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "driver.py"), *args], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(log: Path, proc: subprocess.Popen, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert proc.poll() is None, f"driver exited early:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def _stop_group(proc: subprocess.Popen) -> None:
    """Kill whatever the driver left behind (its process group only: nothing this test did not start)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


@pytest.mark.slow  # ~80 s: a real driver killed mid-step, then resumed (make test-slow)
def test_sigkill_mid_step_then_resume(tiny_model_dir, tmp_path, s3_endpoint):
    boto3.client("s3").create_bucket(Bucket="rayrl-ckpt")
    data = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t-{i}", "prompt": f"What is {i} + 1?", "metadata": {"question": f"What is {i} + 1?",
             "answer": i + 1}} for i in range(12)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "--config", str(ROOT / "examples" / "calculator" / "config.yaml"),
        f"model.path={tiny_model_dir}", "exp_id=sigkill", f"logging.output_dir={tmp_path / 'runs'}",
        f"data.train_path={data}", "data.val_path=null", "data.shuffle=false", "engine.dtype=float32",
        "rollout.reward=tests.e2e_support:parity_reward", "rollout.prompts_per_step=2", "rollout.group_size=2",
        # 1.5 s of sandbox work per episode: a step cannot finish between "step 3 rollout" and the kill
        "rollout.agent=tests.pipeline.pipeline_support:SlowToolAgent",
        "rollout.max_tokens=8", "rollout.max_turns=1", "rollout.few_shot_examples=0", "trainer.steps=4",
        "sandbox_pool.min_warm=1", "logging.tensorboard=false", "logging.plot=false",
        "pipeline.checkpoint_interval=1", "pipeline.keep_checkpoints=2",
        "pipeline.checkpoint_dir=s3://rayrl-ckpt/runs/sigkill", "ray.include_dashboard=false", "ray.num_cpus=4",
    ]
    first_log = tmp_path / "first.log"
    first = _driver(args, first_log)
    try:
        _wait_for(first_log, first, "checkpoint: s3://rayrl-ckpt/runs/sigkill/step000002", 300)
        _wait_for(first_log, first, "step 3 rollout", 60)  # step 3 has started: kill it mid-step
        first.send_signal(signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
    finally:
        _stop_group(first)
    assert "step 3/4 |" not in first_log.read_text()

    second_log = tmp_path / "second.log"
    second = _driver([*args, "--resume"], second_log)
    try:
        assert second.wait(400) == 0, second_log.read_text()[-4000:]
    finally:
        _stop_group(second)
    out = second_log.read_text()
    assert "resumed from s3://rayrl-ckpt/runs/sigkill/step000002 at step 2" in out
    assert "step 3/4 |" in out and "step 4/4 |" in out and "step 1/4 |" not in out

    run_dir = tmp_path / "runs" / "sigkill"
    per_step = {}
    for step in range(1, 5):
        lines = (run_dir / "episodes" / f"step{step:06d}.jsonl").read_text().splitlines()
        per_step[step] = sorted({json.loads(line)["task_id"] for line in lines})
    # data.shuffle=false: step k trains tasks 2k-2 and 2k-1, whatever happened in between
    assert per_step == {k: [f"t-{2 * k - 2}", f"t-{2 * k - 1}"] for k in range(1, 5)}
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "rollout/reward_mean" in line]
    assert logged == [1, 2, 3, 4]  # the killed step never logged; each step's metrics once
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="rayrl-ckpt")["Contents"]]
    steps = sorted({k.split("/")[2] for k in keys if k.endswith("pipeline.json")})
    assert steps == ["step000003", "step000004"]  # keep_checkpoints=2 pruned the older ones
