"""The README's cluster recipe, as written: `ray start --head`, then `ray job submit --working-dir . -- python
driver.py ...` with the real CLIs, on a run whose agent and reward are the user's own modules
(examples/unit_convert: they reach the job through the working dir). The run's files are where the
driver said they are: an absolute path on the driver's node, outside Ray's temporary copy of the working
dir. The fast check of the path rule is tests/config/test_output_paths.py.

The head node gets its own HOME (so its auth token and the run's `~/runs` are the test's own), free
ports and its own temp dir; it is stopped on every exit path, and the test fails if any process that
names its temp dir outlives it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rayrl.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _pids_naming(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (the head's unique temp dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture
def head_node(tmp_path):
    """A Ray head started the way the README says (`ray get-auth-token --generate`, then
    `RAY_AUTH_MODE=token ray start --head`); yields (dashboard URL, the environment a user's shell has)."""
    home = tmp_path / "home"
    home.mkdir()
    gcs, dash = free_port(), free_port()
    temp = Path("/tmp") / f"rayrl-job-{os.getpid()}-{gcs}"  # short: Ray's socket paths are long
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env.update(HOME=str(home), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                   timeout=60)
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=4", f"--temp-dir={temp}",
         "--disable-usage-stats"],
        env={**env, "RAY_AUTH_MODE": "token"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        url = f"http://127.0.0.1:{dash}"
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                    break
            except urllib.error.HTTPError:  # 401 without the token: the dashboard is up, and protected
                break
            except OSError:
                if head.poll() is not None:
                    pytest.fail("ray start failed:\n" + head.stdout.read())
                if time.monotonic() > deadline:
                    pytest.fail("the head's dashboard did not answer in 180 s")
                time.sleep(1)
        yield url, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        for pid in _pids_naming(str(temp)):  # ours (they name the head's own temp dir), left by a slow shutdown
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        while _pids_naming(str(temp)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _pids_naming(str(temp)), "processes of the head node survived SIGKILL"
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow  # ~3 min on 2 cores: a head node with its dashboard, then a whole training step (make test-slow)
def test_the_readme_ray_job_submit_works_on_a_ray_start_head_cluster(head_node, tiny_model_dir):
    url, env = head_node
    # the client needs RAY_AUTH_MODE=token to send the token (~/.ray/auth_token); without it Ray answers 401
    refused = subprocess.run([str(BIN / "ray"), "job", "list", "--address", url], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "token authentication is enabled" in (refused.stdout + refused.stderr).lower()

    command = [str(BIN / "ray"), "job", "submit", "--address", url, "--working-dir", ".", "--",
               "python", "driver.py", "--config", "examples/unit_convert/config.yaml", "trainer.steps=1",
               f"model.path={tiny_model_dir}", "engine.dtype=float32", "rollout.prompts_per_step=2",
               "rollout.group_size=2", "rollout.max_tokens=8", "rollout.max_turns=1", "logging.tensorboard=false",
               "data.val_path=null"]
    for _ in range(12):  # a head just started may have no job agent yet: Ray says to try again later
        job = subprocess.run(command, env={**env, "RAY_AUTH_MODE": "token"}, cwd=ROOT, capture_output=True,
                             text=True, timeout=540)
        logs = job.stdout + job.stderr
        if job.returncode == 0 or "No available agent to submit job" not in logs:
            break
        time.sleep(5)
    assert job.returncode == 0, logs[-4000:]
    assert "step 1/1 |" in logs
    printed = re.search(r"\[rayrl\] run directory: (\S+)", logs)
    assert printed, logs[-3000:]
    run_dir = Path(printed.group(1))
    assert run_dir == Path(env["HOME"]) / "runs" / "unit_convert"  # absolute, not inside Ray's working-dir copy
    assert f"[rayrl] metrics: {run_dir / 'metrics.jsonl'}" in logs
    assert [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    episodes = (run_dir / "episodes" / "step000001.jsonl").read_text().splitlines()
    assert len(episodes) >= 4 and '"harness": "examples.unit_convert.agent:solve"' in episodes[0]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints" / "step000001").is_dir()
