"""Stopping a child process: one way, used by whoever started it (local AgentCore, test servers).

Its own module so that code which only stops processes need not import the engine launcher.
"""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc``, SIGKILL it if it has not exited after ``grace_s``, and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
