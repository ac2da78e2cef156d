"""``rollout.tool_delay_s``: the calculator takes real time inside its (real, isolated) sandbox."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from rayrl.agents.toolbox import make_tools
from rayrl.config import SandboxConfig
from rayrl.sandboxes.local import LocalSandbox


def test_calculator_delay_runs_in_the_sandbox():
    root = tempfile.mkdtemp(prefix="rayrl-delaytest-", dir="/tmp")  # reachable by the sandbox's uid
    os.chmod(root, 0o711)
    sandbox = LocalSandbox(SandboxConfig(isolation="auto", timeout_s=30), root=root)
    try:
        (slow,) = make_tools(["calculator"], delay_s=(0.6, 0.8))
        (fast,) = make_tools(["calculator"])
        slow.setup(sandbox)
        started = time.monotonic()
        assert slow.call(sandbox, {"expression": "(3 + 5) * 9"}) == ("72", True)
        assert time.monotonic() - started >= 0.6
        assert fast.call(sandbox, {"expression": "40 - 13"}) == ("27", True)
        assert fast.delay_s == () and slow.delay_s == (0.6, 0.8)
    finally:
        sandbox.close()
        shutil.rmtree(root, ignore_errors=True)
