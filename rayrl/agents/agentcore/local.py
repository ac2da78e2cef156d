"""Local mode: the whole AgentCore flow on this machine, with the launcher's code path unchanged.

Three processes on loopback: a ``moto`` S3 server (a fake of S3 that speaks its real protocol), the
agent app (the author's own file, e.g. ``python examples/agentcore/math_agent.py``, serving
``/ping`` and ``/invocations`` on ``$PORT``) and the FAKE AgentCore Runtime (emulator.py) in front of it.
``start()`` returns the AgentCoreConfig pointed at them; boto3 reaches both with ``endpoint_url``.

The agent app gets ``AWS_ENDPOINT_URL_S3`` and dummy credentials in its environment, so its plain
``boto3.client("s3")`` writes to the moto server. Children are started from one keeper thread with
``PR_SET_PDEATHSIG`` (Linux), so they die with the process that owns them even when it is killed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from rayrl.agents.agentcore.emulator import DEFAULT_LOCAL_ARN
from rayrl.config import AgentCoreConfig
from rayrl.ports import free_port
from rayrl.processes import stop_process

LOCAL_CREDENTIALS = {"aws_access_key_id": "rayrl-local", "aws_secret_access_key": "rayrl-local"}
DEFAULT_LOCAL_BUCKET = "rayrl-local-rollouts"


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the thread that started it ends (Linux prctl)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen, name: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"local agentcore: {name} exited with code {proc.returncode} (see its log)")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status < 500:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"local agentcore: {name} did not answer {url} within {timeout_s:.0f} s")


class LocalAgentCore:
    """Starts and stops moto S3 + the agent app + the emulator; ``start()`` gives the config to use."""

    def __init__(self, cfg: AgentCoreConfig, log_dir: str | Path, startup_timeout_s: float = 90.0,
                 emulator_args: list[str] | None = None) -> None:
        if not cfg.local_agent_command:
            raise ValueError("agentcore.local_agent_command is empty")
        self.cfg = cfg
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.emulator_args = list(emulator_args or [])
        self.procs: dict[str, subprocess.Popen] = {}
        self._queue: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._keeper: threading.Thread | None = None

    def _command(self) -> list[str]:
        command = list(self.cfg.local_agent_command)
        if command and command[0] in ("python", "python3"):
            command[0] = sys.executable  # the same interpreter (and venv) as the trainer
        return command

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], stdout: Any = None) -> subprocess.Popen:
        """Start a child from the keeper thread (PR_SET_PDEATHSIG is tied to that thread's life)."""
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, daemon=True, name="local-agentcore-keeper")
            self._keeper.start()
        reply: Future = Future()
        self._queue.put((name, argv, env, stdout, reply))
        return reply.result(timeout=60)

    def _keep(self) -> None:
        while (item := self._queue.get()) is not None:
            name, argv, env, stdout, reply = item
            try:
                with open(self.log_dir / f"agentcore-{name}.log", "ab") as log:  # the child has its own fd
                    reply.set_result(subprocess.Popen(argv, env=env, stdout=stdout or log, stderr=log,
                                                      preexec_fn=_die_with_parent))
            except Exception as err:
                reply.set_exception(err)
        self._stopped.wait()  # children die when this thread ends: only after stop()

    def start(self) -> tuple[AgentCoreConfig, dict[str, str]]:
        """Start the three processes; returns (config pointed at them, boto3 credentials for them)."""
        try:
            return self._start()
        except BaseException:
            self.stop()  # whatever did start goes again
            raise

    def _start(self) -> tuple[AgentCoreConfig, dict[str, str]]:
        import boto3

        self.log_dir.mkdir(parents=True, exist_ok=True)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        aws_env = {"AWS_ACCESS_KEY_ID": LOCAL_CREDENTIALS["aws_access_key_id"],
                   "AWS_SECRET_ACCESS_KEY": LOCAL_CREDENTIALS["aws_secret_access_key"],
                   "AWS_DEFAULT_REGION": self.cfg.region, "AWS_REGION": self.cfg.region}
        s3_url = self.cfg.s3_endpoint_url
        if not s3_url:
            port = free_port()
            argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
            proc = self._spawn("moto", argv, {**base_env, **aws_env})
            self.procs["moto"] = proc
            s3_url = f"http://127.0.0.1:{port}"
            _wait_http(f"{s3_url}/moto-api/", self.startup_timeout_s, proc, "moto S3 server")
        bucket = self.cfg.s3_bucket or DEFAULT_LOCAL_BUCKET
        s3 = boto3.client("s3", endpoint_url=s3_url, region_name=self.cfg.region, **LOCAL_CREDENTIALS)
        existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
        if bucket not in existing:  # us-east-1 is S3's default location: naming it is an error there
            where = {} if self.cfg.region == "us-east-1" else {
                "CreateBucketConfiguration": {"LocationConstraint": self.cfg.region}}
            s3.create_bucket(Bucket=bucket, **where)

        agent_port = free_port()
        agent_env = {**base_env, **aws_env, "AWS_ENDPOINT_URL_S3": s3_url, "PORT": str(agent_port),
                     "PYTHONUNBUFFERED": "1"}
        agent = self._spawn("agent", self._command(), agent_env)
        self.procs["agent"] = agent
        agent_url = f"http://127.0.0.1:{agent_port}"
        _wait_http(f"{agent_url}/ping", self.startup_timeout_s, agent, "agent app")

        arn = self.cfg.runtime_arn or DEFAULT_LOCAL_ARN
        emulator = self._spawn(
            "emulator",
            [sys.executable, "-m", "rayrl.agents.agentcore.emulator", "--agent-url", agent_url,
             "--runtime-arn", arn, "--port", "0", *self.emulator_args],
            {**base_env, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            stdout=subprocess.PIPE,
        )
        self.procs["emulator"] = emulator
        assert emulator.stdout is not None
        line = emulator.stdout.readline().decode()
        if not line.strip():
            raise RuntimeError("local agentcore: the emulator exited before printing its address")
        emulator_url = json.loads(line)["url"]
        _wait_http(f"{emulator_url}/ping", self.startup_timeout_s, emulator, "emulator")
        local = dataclasses.replace(self.cfg, runtime_arn=arn, endpoint_url=emulator_url, s3_bucket=bucket,
                                    s3_endpoint_url=s3_url)
        return local, dict(LOCAL_CREDENTIALS)

    def stop(self) -> None:
        """Terminate our children (by pid), agent first; then end the keeper thread."""
        for name in ("emulator", "agent", "moto"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                stop_process(proc)
        self._queue.put(None)
        self._stopped.set()

    def __enter__(self) -> "LocalAgentCore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
