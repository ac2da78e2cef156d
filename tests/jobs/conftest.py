"""Fixtures for the job-submission tests: a real Ray head to submit to."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rayrl.ports import free_port


@pytest.fixture
def ray_head(tmp_path):
    """`ray start --head --block` on loopback; terminating it stops exactly the processes it started."""
    gcs, dash = free_port(), free_port()
    temp = Path("/tmp") / f"rayrl-test-{os.getpid()}-{gcs}"  # short path: Ray's socket names are long
    # the job's `python driver.py` finds python on the PATH the head was started with: this venv's, as
    # for a user who activated it (make calls .venv/bin/python without activating anything)
    env = {**os.environ, "RAY_ADDRESS": "",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=4",
         "--include-dashboard=true", f"--temp-dir={temp}", "--disable-usage-stats"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                break
        except urllib.error.HTTPError:  # 401: Ray turned token auth on (~/.ray/auth_token exists); it is up
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail("ray start failed:\n" + proc.stdout.read())
            time.sleep(1)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
