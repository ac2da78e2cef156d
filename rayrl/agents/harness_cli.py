"""Shared machinery for harnesses that run an agent CLI (Claude Code, Codex) once per task.

The CLI runs unmodified; only its environment points it at the gateway with the session's token. Two
places it can run:

* **in the episode's sandbox** (``ctx.sandbox`` set): through ``Sandbox.exec``. Its HOME and config
  files live in the sandbox's working directory (``.agent-home``). The CLI binary must be visible
  inside the sandbox: local (bubblewrap) sandboxes bind ``/usr`` read-only, so install the CLIs under
  it (``RAYRL_AGENT_CLIS_DIR=/usr/local/lib/rayrl-agent-clis bash scripts/install_agent_clis.sh``);
  e2b templates need them in the image. The sandbox needs ``sandbox.network: true`` to reach the
  gateway (a local sandbox then shares the host's loopback), and Claude Code needs
  ``sandbox.memory_mb`` of about 8192 (its bun runtime reserves a large address space).
* **as a host subprocess** (no sandbox): in a fresh temporary directory (or ``workdir``), with an
  isolated HOME, stdin from /dev/null and a hard timeout. Use this when the sandbox cannot run the
  CLI; the CLI's own tool sandboxing (Codex's bubblewrap) then still applies.

Either way the run is bounded by the episode deadline, and the CLI's retries are capped so a broken
gateway fails the episode quickly instead of backing off for minutes.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from rayrl.agents.base import AgentResult, BaseHarness, EpisodeContext
from rayrl.types import Task

CLIS_DIR_ENV = "RAYRL_AGENT_CLIS_DIR"
_REPO_ROOT = Path(__file__).resolve().parents[2]
SANDBOX_WORKSPACE = "/workspace"  # where a local sandbox's working directory appears inside it
_MIN_TIMEOUT_S = 5.0


class CLINotFound(RuntimeError):
    """The agent CLI is not installed where the harness looks (the message says how to install it)."""


def default_bin_dirs() -> list[Path]:
    """Where installed CLIs are looked for, in order: $RAYRL_AGENT_CLIS_DIR, the repo's .cache."""
    dirs = []
    if os.environ.get(CLIS_DIR_ENV):
        dirs.append(Path(os.environ[CLIS_DIR_ENV]) / "node_modules" / ".bin")
    dirs.append(_REPO_ROOT / ".cache" / "agent-clis" / "node_modules" / ".bin")
    return dirs


def find_cli(name: str, cli_dir: str | os.PathLike | None = None) -> str:
    """Absolute path of the CLI ``name`` (``claude``/``codex``): ``cli_dir``, then the install
    locations of scripts/install_agent_clis.sh, then PATH."""
    candidates = [Path(cli_dir)] if cli_dir else default_bin_dirs()
    for d in candidates:
        path = d / name
        if path.exists() and os.access(path, os.X_OK):
            return str(path.resolve())
    found = shutil.which(name)
    if found and not cli_dir:
        return found
    raise CLINotFound(f"{name} not found in {', '.join(map(str, candidates))} or PATH; install it with "
                      f"`bash scripts/install_agent_clis.sh`")


@dataclass
class CLIInvocation:
    """One CLI run: arguments, environment, and files to create first (paths relative to HOME)."""

    argv: list[str]
    env: dict[str, str]
    home_files: dict[str, str] = field(default_factory=dict)
    output_file: str | None = None  # relative to the working directory: the CLI writes its answer there


@dataclass
class CLIOutcome:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    output_file_text: str | None = None


class CLIHarness(BaseHarness):
    """Base class: subclasses say how to invoke their CLI and how to read its answer."""

    cli_name = ""

    def __init__(
        self,
        cli_dir: str | None = None,
        extra_args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        workdir: str | None = None,
        max_retries: int = 1,
        prompt_key: str = "prompt",
    ) -> None:
        self.cli_dir = cli_dir
        self.extra_args = list(extra_args or [])
        self.extra_env = dict(extra_env or {})
        self.workdir = workdir
        self.max_retries = max_retries
        self.prompt_key = prompt_key

    # -- what subclasses provide -------------------------------------------------------------------

    @abstractmethod
    def invocation(
        self, task: Task, ctx: EpisodeContext, binary: str, home: str, prompt: str, sandboxed: bool
    ) -> CLIInvocation:
        """argv/env/files for one run; ``home`` is the isolated HOME (a path where the CLI runs)."""

    @abstractmethod
    def read_result(self, outcome: CLIOutcome) -> AgentResult:
        """The agent's result from what the CLI printed or wrote."""

    # -- running -----------------------------------------------------------------------------------

    def prompt_of(self, task: Task) -> str:
        payload = task.payload()
        prompt = payload.get(self.prompt_key) or payload.get("question") or task.prompt
        return str(prompt)

    def base_env(self, home: str, sandboxed: bool) -> dict[str, str]:
        """HOME, PATH and a plain terminal; ``extra_env`` last so a caller can override anything."""
        path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        env = {
            "HOME": home,
            "PATH": path if sandboxed else os.environ.get("PATH", path),
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "NO_COLOR": "1",
        }
        env.update(self.extra_env)
        return env

    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        timeout = ctx.time_left()
        if timeout == float("inf"):
            timeout = 600.0
        if timeout < _MIN_TIMEOUT_S:
            return AgentResult(status="error", error="no time left to start the agent CLI")
        try:
            binary = find_cli(self.cli_name, self.cli_dir)
        except CLINotFound as err:
            return AgentResult(status="error", error=str(err))
        prompt = self.prompt_of(task)
        if ctx.sandbox is not None:
            outcome = self._run_in_sandbox(task, ctx, binary, prompt, timeout)
        else:
            outcome = self._run_on_host(task, ctx, binary, prompt, timeout)
        result = self.read_result(outcome)
        if outcome.timed_out:
            result.status, result.error = "error", f"{self.cli_name} timed out after {timeout:.0f} s"
        elif outcome.exit_code != 0 and result.status != "error":
            result.status = "error"
            result.error = f"{self.cli_name} exited with {outcome.exit_code}: {outcome.stderr.strip()[-2000:]}"
        return result

    def _run_on_host(self, task: Task, ctx: EpisodeContext, binary: str, prompt: str, timeout: float) -> CLIOutcome:
        # Not under /tmp: Codex refuses to create its sandbox helper links in a temporary directory
        # (its commands then fail with "execvp codex-linux-sandbox").
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rayrl" / "agent-runs"
        base.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"{self.cli_name}-", dir=base) as tmp:
            home = os.path.join(tmp, "home")
            workdir = self.workdir or os.path.join(tmp, "work")
            os.makedirs(home)
            os.makedirs(workdir, exist_ok=True)
            inv = self.invocation(task, ctx, binary, home, prompt, sandboxed=False)
            for rel, text in inv.home_files.items():
                path = os.path.join(home, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(text)
            started = time.monotonic()
            try:
                proc = subprocess.run(inv.argv, env=inv.env, cwd=workdir, stdin=subprocess.DEVNULL,
                                      capture_output=True, text=True, timeout=timeout, start_new_session=True)
                code, out, err, timed_out = proc.returncode, proc.stdout, proc.stderr, False
            except subprocess.TimeoutExpired as exc:
                code, timed_out = 137, True
                out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            answer = None
            if inv.output_file:
                path = os.path.join(workdir, inv.output_file)
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        answer = f.read()
            return CLIOutcome(code, out, err, timed_out, time.monotonic() - started, answer)

    def _run_in_sandbox(self, task: Task, ctx: EpisodeContext, binary: str, prompt: str, timeout: float) -> CLIOutcome:
        sandbox = ctx.sandbox
        assert sandbox is not None
        home_rel = ".agent-home"
        home = f"{SANDBOX_WORKSPACE}/{home_rel}"
        inv = self.invocation(task, ctx, binary, home, prompt, sandboxed=True)
        sandbox.write_file(f"{home_rel}/.keep", b"")
        for rel, text in inv.home_files.items():
            sandbox.write_file(f"{home_rel}/{rel}", text.encode())
        command = " ".join(shlex.quote(a) for a in inv.argv) + " </dev/null"
        res = sandbox.exec(command, timeout=timeout, env=inv.env)
        answer = None
        if inv.output_file:
            try:
                answer = sandbox.read_file(inv.output_file).decode(errors="replace")
            except Exception:  # the CLI wrote nothing (it failed): the exit code says why
                answer = None
        return CLIOutcome(res.exit_code, res.stdout, res.stderr, res.timed_out, res.duration_s, answer)
