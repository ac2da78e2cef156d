"""SIGTERM (``ray job stop``, ``timeout``, a preempted node) stops a run as Ctrl-C does: one line naming the
newest checkpoint and the resume command, exit 143, and nothing of the run left running.

driver.py runs as a real subprocess with its own local Ray (in its own process group, so the test can see
whether any process of the run outlives the driver).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.pipeline.test_sigkill_resume import ROOT, _driver, _stop_group, _wait_for


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.slow  # ~60 s: a real driver stopped by SIGTERM in its second step (make test-slow)
def test_sigterm_stops_the_run_with_its_resume_line_and_leaves_nothing_running(tiny_model_dir, tmp_path: Path):
    args = [
        "--config", str(ROOT / "examples" / "calculator" / "config.yaml"),
        f"model.path={tiny_model_dir}", "exp_id=sigterm", f"logging.output_dir={tmp_path / 'runs'}",
        "data.val_path=null", "engine.dtype=float32",
        "rollout.reward=tests.e2e_support:parity_reward", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.agent=tests.pipeline.pipeline_support:SlowToolAgent",  # a step cannot end before the signal
        "rollout.max_tokens=8", "rollout.max_turns=1", "rollout.few_shot_examples=0", "trainer.steps=4",
        "sandbox_pool.min_warm=1", "logging.tensorboard=false", "logging.plot=false",
        "pipeline.checkpoint_interval=1", "ray.include_dashboard=false", "ray.num_cpus=4",
    ]
    log = tmp_path / "driver.log"
    proc = _driver(args, log)
    try:
        _wait_for(log, proc, "step000001", 300)  # step 1's checkpoint written
        _wait_for(log, proc, "step 2 rollout", 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM, log.read_text()[-4000:]
        text = log.read_text()
        line = next((x for x in text.splitlines() if "stopped by SIGTERM" in x), None)
        assert line is not None, text[-4000:]
        assert "at step 2" in line and "step000001" in line, line
        assert f"--config {tmp_path / 'runs' / 'sigterm' / 'config.yaml'} --resume" in line, line
        assert "Traceback" not in text[text.index("step 2 rollout"):], text[-4000:]
        deadline = time.monotonic() + 30  # Ray's own processes go with the driver's ray.shutdown()
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _group_alive(proc.pid), os.popen(f"ps -o pid,args -g {proc.pid}").read()
    finally:
        _stop_group(proc)
