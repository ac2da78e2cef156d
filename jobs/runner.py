"""Runner: submit a whole experiment to a Ray cluster from Python.

    Runner(exp_id="calc-1", config="examples/calculator/config.yaml", steps=20).submit()

Required fields name the experiment; optional ones have defaults; ``overrides`` are dotted config
overrides and ``extra_args`` pass through to driver.py verbatim. Submission goes through Ray's Job
Submission SDK: no shell scripts, no process killing, no ``ray stop``. The same dataclass round-trips
through YAML, so an experiment can be kept as a file (:class:`YamlDataclass`, shared with
jobs/agentcore_runner.py's ``AgentCoreRunner``).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


class YamlDataclass:
    """``to_yaml`` / ``from_yaml`` for a dataclass of plain fields; unknown keys fail naming the key."""

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(dataclasses.asdict(self), sort_keys=False)  # type: ignore[call-overload]
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, source: str | Path) -> Any:
        """From a YAML file path or YAML text."""
        text = Path(source).read_text() if Path(str(source)).is_file() else str(source)
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__} YAML must be a mapping")
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)}")
        return cls(**data)


@dataclass
class Runner(YamlDataclass):
    """One experiment as a Ray job."""

    exp_id: str  # run name (runs/<exp_id>/ on the cluster); also the job's submission id prefix
    config: str  # YAML run config, relative to working_dir
    address: str = "http://127.0.0.1:8265"  # the cluster's dashboard / job API address
    working_dir: str = "."  # uploaded to the cluster; must contain driver.py
    model_path: str | None = None  # overrides model.path
    data_path: str | None = None  # overrides data.train_path
    steps: int | None = None  # overrides trainer.steps
    resume: bool = False  # continue from the run's newest checkpoint
    overrides: list[str] = field(default_factory=list)  # more dotted overrides, e.g. rollout.group_size=8
    extra_args: list[str] = field(default_factory=list)  # passed verbatim to driver.py
    env_vars: dict[str, str] = field(default_factory=dict)  # job environment (e.g. WANDB_API_KEY)
    pip: list[str] = field(default_factory=list)  # extra pip packages for the job's runtime_env
    excludes: list[str] = field(default_factory=lambda: [".venv", "runs", ".cache", ".git"])  # not uploaded
    entrypoint_num_cpus: float = 0.0  # CPUs reserved for the driver process
    auth_token: str | None = None  # Ray token auth; default: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token

    def __post_init__(self) -> None:
        for name in ("exp_id", "config"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"Runner.{name} is required")

    # -- what gets submitted ---------------------------------------------------------------------

    def driver_args(self) -> list[str]:
        args = ["--config", self.config]
        if self.resume:
            args.append("--resume")
        args += [f"exp_id={self.exp_id}"]
        if self.model_path:
            args.append(f"model.path={self.model_path}")
        if self.data_path:
            args.append(f"data.train_path={self.data_path}")
        if self.steps is not None:
            args.append(f"trainer.steps={self.steps}")
        return args + list(self.overrides) + list(self.extra_args)

    def entrypoint(self) -> str:
        return "python driver.py " + " ".join(shlex.quote(a) for a in self.driver_args())

    def runtime_env(self) -> dict[str, Any]:
        env: dict[str, Any] = {"working_dir": self.working_dir, "excludes": list(self.excludes)}
        if self.env_vars:
            env["env_vars"] = dict(self.env_vars)
        if self.pip:
            env["pip"] = list(self.pip)
        return env

    # -- submission --------------------------------------------------------------------------------

    def _token(self) -> str | None:
        if self.auth_token:
            return self.auth_token
        if os.environ.get("RAY_AUTH_TOKEN"):
            return os.environ["RAY_AUTH_TOKEN"]
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
        return path.read_text().strip() if path.is_file() else None

    def _client(self) -> Any:
        from ray.job_submission import JobSubmissionClient

        token = self._token()
        headers = {"Authorization": f"Bearer {token}"} if token else None
        # Ray's client takes RAY_API_SERVER_ADDRESS or RAY_ADDRESS from the environment over the address it is
        # given (RAY_ADDRESS=local or auto then means "whichever Ray runs on this machine"): the runner's own
        # address wins, so a job goes to the cluster it names
        saved = {k: os.environ.pop(k) for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS") if k in os.environ}
        try:
            return JobSubmissionClient(self.address, headers=headers)
        finally:
            os.environ.update(saved)

    def submit(self, agent_wait_s: float = 120.0) -> str:
        """Submit the job; returns its submission id.

        Right after a cluster starts, its dashboard answers before the job agent is ready ("No available
        agent to submit job"); that one condition is retried for up to ``agent_wait_s``.
        """
        submission_id = f"{self.exp_id}-{int(time.time())}"
        client = self._client()
        deadline = time.monotonic() + agent_wait_s
        while True:
            try:
                return client.submit_job(
                    entrypoint=self.entrypoint(),
                    runtime_env=self.runtime_env(),
                    submission_id=submission_id,
                    entrypoint_num_cpus=self.entrypoint_num_cpus,
                )
            except RuntimeError as err:
                if "No available agent" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(2.0)

    def status(self, job_id: str) -> str:
        return str(self._client().get_job_status(job_id).value)

    def wait(self, job_id: str, timeout_s: float = 3600.0, poll_s: float = 2.0) -> str:
        """Poll until the job ends (SUCCEEDED / FAILED / STOPPED) or the timeout; returns the status."""
        deadline = time.monotonic() + timeout_s
        status = self.status(job_id)
        while status not in _TERMINAL and time.monotonic() < deadline:
            time.sleep(poll_s)
            status = self.status(job_id)
        return status

    def logs(self, job_id: str) -> str:
        return self._client().get_job_logs(job_id)

    def stop(self, job_id: str) -> bool:
        """Ask Ray to stop the job (the driver gets SIGTERM, then SIGKILL after Ray's grace period)."""
        return bool(self._client().stop_job(job_id))
