"""Hidden-tests reward: 1.0 when the task's hidden tests pass on the agent's final files, else 0.0.

For SWE-style tasks (examples/swe). The episode's sandbox held the repository (``metadata.files``) and the
agent edited it; EpisodeRunner collected the final files into ``result.info["files"]``. This reward puts
those files into a *fresh* sandbox together with the hidden tests (``metadata.hidden_tests``: path ->
text; never written into the agent's sandbox, so the agent can neither read nor edit its way to a pass)
and runs ``metadata.test_command`` there (default: stdlib unittest over ``hidden/``, imported before the
repository is on the path, so a file the agent wrote cannot replace the test machinery). A failing or timed-out
test run scores 0; a sandbox that cannot be made raises, which fails the episode as an infrastructure
failure instead of scoring it.
"""

from __future__ import annotations

from typing import Any

from rayrl.agents.base import AgentResult
from rayrl.config import SandboxConfig
from rayrl.types import Task

TEST_TIMEOUT_S = 60.0
RUNNER = ".run_hidden_tests.py"
# Runs the hidden tests with the standard library's unittest, imported *before* the repository is put on
# the path (appended, never first), in isolated mode: a file the agent left (unittest.py, sitecustomize.py,
# a conftest) cannot take the place of the test machinery.
RUNNER_SCRIPT = r'''
import sys, unittest
sys.path.append(".")
suite = unittest.defaultTestLoader.discover("hidden", top_level_dir="hidden")
result = unittest.TextTestRunner(verbosity=1).run(suite)
sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)
'''
DEFAULT_TEST_COMMAND = ["python3", "-I", RUNNER]


def _files(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{what} must map relative paths to text")
    return value


def run_hidden_tests(files: dict[str, str], hidden: dict[str, str], command: list[str],
                     timeout_s: float = TEST_TIMEOUT_S) -> tuple[bool, str]:
    """Run ``command`` in a fresh local sandbox holding ``files`` and ``hidden`` under ``hidden/``;
    returns (passed, the output's tail)."""
    from rayrl.sandboxes.local import LocalSandbox

    sandbox = LocalSandbox(SandboxConfig(timeout_s=timeout_s))
    try:
        for path, text in files.items():
            if path.split("/")[0] not in ("hidden", RUNNER):  # the agent's files never stand in for the tests
                sandbox.write_file(path, text.encode())
        for path, text in hidden.items():
            sandbox.write_file(f"hidden/{path}", text.encode())
        sandbox.write_file(RUNNER, RUNNER_SCRIPT.encode())
        result = sandbox.exec(command, timeout=timeout_s)
    finally:
        sandbox.close()
    output = (result.stdout + result.stderr)[-2000:]
    return result.exit_code == 0 and not result.timed_out, output


def hidden_tests_reward(task: Task, result: AgentResult) -> float:
    """1.0 if the hidden tests pass on the files the agent left, 0.0 otherwise (see the module docstring)."""
    meta = task.metadata if isinstance(task.metadata, dict) else {}
    hidden = _files(meta.get("hidden_tests"), "metadata.hidden_tests")
    files = _files(result.info.get("files", {}), "the collected files")
    if not files:
        return 0.0
    command = meta.get("test_command") or DEFAULT_TEST_COMMAND
    passed, output = run_hidden_tests(files, hidden, [str(c) for c in command])
    result.info["hidden_tests_output"] = output
    return 1.0 if passed else 0.0
