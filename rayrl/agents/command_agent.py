"""Any agent program as the agent: it reads its endpoint from the environment, the task from stdin, and
prints its answer (``rollout.agent: command`` with ``rollout.agent_command: [python, my_agent.py]``).

The program needs no rayrl code at all: the openai SDK reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``
by itself, the Anthropic SDK ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY``. What it gets:

* environment: everything the rollout worker has, plus :func:`endpoint_env`;
* stdin: the task as one JSON object, the dataset row's shape: ``{"id", "prompt", "metadata"}``;
* working directory: the run's (where ``python driver.py`` was started; the job's working directory
  under ``ray job submit``), so relative paths in the command resolve as they did at load.

Its stdout, stripped, is the final answer (write logs to stderr: the end of it, :data:`STDERR_KEEP_CHARS`
characters, is kept with every episode's record as ``stderr``, successes included). Exit code 0 is a
completed episode; any other exit code (or no exit by the episode deadline, when its whole process group
is killed) fails the episode against the task, with stderr's tail as the error. An exit code of
:data:`INFRA_EXIT_CODE` says the program's own infrastructure failed (a service it needs was down): the
episode is an infrastructure failure instead (rayrl/rl/failures.py). ``python`` as the first word means the Python
that runs rayrl, so the program sees the same packages. It runs on the host, with no sandbox.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from rayrl.agents.base import AgentResult, BaseHarness, Endpoint, EpisodeContext
from rayrl.rl.failures import SERVICE_FAILED, TIMED_OUT
from rayrl.types import Task

INFRA_EXIT_CODE = 75  # EX_TEMPFAIL: "a service I need failed", not the agent's doing
ERROR_TAIL_CHARS = 2000
STDERR_KEEP_CHARS = 4000  # the end of every episode's stderr kept in its record (episodes/, the inspector)


def stderr_tail(err: str | None) -> str:
    """The last :data:`STDERR_KEEP_CHARS` characters of a program's stderr, marked when cut."""
    err = (err or "").rstrip()
    return err if len(err) <= STDERR_KEEP_CHARS else "…" + err[-STDERR_KEEP_CHARS:]


def endpoint_env(endpoint: Endpoint) -> dict[str, str]:
    """The variables an agent program finds its endpoint and the run's settings in."""
    return {
        "OPENAI_BASE_URL": endpoint.base_url,
        "OPENAI_API_KEY": endpoint.api_key,
        "OPENAI_MODEL": endpoint.model,
        "ANTHROPIC_BASE_URL": endpoint.anthropic_base_url,
        "ANTHROPIC_API_KEY": endpoint.api_key,
        "ANTHROPIC_MODEL": endpoint.model,
        "RAYRL_TEMPERATURE": repr(endpoint.temperature),
        "RAYRL_TOP_P": repr(endpoint.top_p),
        "RAYRL_MAX_TOKENS": str(endpoint.max_tokens),
        "RAYRL_MAX_TURNS": str(endpoint.max_turns),
    }


def command_argv(command: list[str]) -> list[str]:
    """``command`` with a leading ``python``/``python3`` replaced by this interpreter."""
    argv = [str(a) for a in command]
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


class CommandAgent(BaseHarness):
    """Runs ``rollout.agent_command`` once per episode (see the module docstring)."""

    name = "command"
    needs_sandbox = False

    def __init__(self, command: list[str]) -> None:
        if not command:
            raise ValueError("rollout.agent_command: empty")
        self.argv = command_argv(command)

    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        row = json.dumps({"id": task.task_id, "prompt": task.prompt, "metadata": task.payload()})
        env = {**os.environ, **endpoint_env(ctx.endpoint()), "RAYRL_TASK_ID": task.task_id}
        left = ctx.time_left()
        proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, start_new_session=True)
        try:
            out, err = proc.communicate(row, timeout=None if left == float("inf") else max(left, 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            return AgentResult(status="error", failure=TIMED_OUT, info={"stderr": stderr_tail(err)},
                               error=f"{self.argv[-1]} was still running at the episode deadline; killed")
        finally:
            if proc.poll() is None:  # the episode thread was interrupted: leave no process behind
                os.killpg(proc.pid, signal.SIGKILL)
        kept = {"stderr": stderr_tail(err)}  # successes too: a warning on stderr is how a quiet bug shows
        if proc.returncode != 0:
            tail = err.strip()[-ERROR_TAIL_CHARS:] or out.strip()[-ERROR_TAIL_CHARS:]
            return AgentResult(status="error", error=f"exited with {proc.returncode}: {tail}", info=kept,
                               failure=SERVICE_FAILED if proc.returncode == INFRA_EXIT_CODE else None)
        return AgentResult(final_answer=out.strip(), status="completed", info=kept)
