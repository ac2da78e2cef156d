"""Constants and helpers shared by the AgentCore tests (imported as ``_agentcore_kit``)."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-west-2"
CREDS = {"aws_access_key_id": "rayrl-test", "aws_secret_access_key": "rayrl-test"}
BUCKET = "rayrl-test-rollouts"


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process for {url} exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


def aws_env(s3_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_ACCESS_KEY_ID": CREDS["aws_access_key_id"],
                "AWS_SECRET_ACCESS_KEY": CREDS["aws_secret_access_key"],
                "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL_S3": s3_url, "PYTHONPATH": str(ROOT)})
    return env


def max_per_window(times: list[float], window_s: float = 1.0) -> int:
    """The most requests whose times fall in any half-open window [t, t + window_s)."""
    times = sorted(times)
    best, j = 0, 0
    for i in range(len(times)):
        while times[i] - times[j] >= window_s:
            j += 1
        best = max(best, i - j + 1)
    return best
