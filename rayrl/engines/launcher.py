"""EngineProcess: one engine server as a subprocess (the CPU engine here, SGLang on GPU).

What to run and with which environment is the backend's (rayrl/engines/backends/); this module only
manages the process.

The process runs in its own process group (so stopping it also stops anything it spawned, e.g. SGLang's
scheduler processes), writes stdout/stderr to a log file, and counts as started only once ``/health``
answers 200. If it dies or times out first, :class:`EngineLaunchError` says so with the log's tail —
the actual reason (a missing model, a port in use, an OOM) is almost always there. A server that dies
because the port this process picked for it was taken meanwhile is started again on a fresh port (up to
``PORT_TRIES`` times); a port the caller chose is the caller's to change.

``die_with_parent`` (Linux): the kernel kills the server when the thread that started it exits, so an
engine whose owner (a Ray actor) is killed does not live on holding its port, its memory and, on GPU,
its device. The owner must start it from a thread that lives as long as the owner does.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Optional

from rayrl.config import EngineConfig
from rayrl.engines.backends import engine_backend
from rayrl.ports import free_port

logger = logging.getLogger(__name__)

PORT_TRIES = 3
_PORT_TAKEN = "address already in use"  # how Python (aiohttp, uvicorn) and C (strerror) report EADDRINUSE

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never goes via a proxy


class EngineLaunchError(RuntimeError):
    """An engine server died or did not become healthy in time."""


PR_SET_PDEATHSIG = 1  # prctl option: the signal this process gets when its parent thread exits


def _kill_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the thread that forked it exits (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class EngineProcess:
    """A managed engine server process. ``start()`` returns once it is healthy."""

    def __init__(
        self,
        cfg: EngineConfig,
        model_path: str,
        log_path: str | Path,
        *,
        backend: str = "cpu",
        port: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        weight_version: str = "0",
        advertise_host: Optional[str] = None,
        die_with_parent: bool = False,
    ) -> None:
        """``advertise_host``: the host in :attr:`url` when it differs from the bind address (a server
        bound to 0.0.0.0 is reached at its node's address)."""
        self.spec = engine_backend(backend)  # ValueError naming the choices
        self.cfg = cfg
        self.model_path = str(model_path)
        self.log_path = Path(log_path)
        self.backend = backend
        self.port = port or free_port(cfg.host)
        self._port_picked = not port  # ours to pick again if it was taken before the server bound it
        self._log_start = 0  # where this start's lines begin in the log
        self.env = dict(env or {})
        self.weight_version = str(weight_version)  # what the checkpoint at model_path is
        self.advertise_host = advertise_host or cfg.host
        self.die_with_parent = die_with_parent
        self._proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        host = self.advertise_host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        return self.spec.command(self.cfg, self.model_path, self.port, weight_version=self.weight_version)

    def start(self, timeout_s: Optional[float] = None) -> "EngineProcess":
        """Launch and wait for /health; raises EngineLaunchError (with the log tail) on failure."""
        if self.alive():
            return self
        tries = 1
        while True:
            self._launch()
            try:
                self._wait_healthy(self.cfg.startup_timeout_s if timeout_s is None else timeout_s)
                return self
            except EngineLaunchError:
                if tries == PORT_TRIES or not (self._port_picked and self._lost_its_port()):
                    raise
            self.stop()  # reap what the dead server left in its process group
            tries += 1
            taken, self.port = self.port, free_port(self.cfg.host)
            logger.warning("the %s engine server's port %d was taken before it bound it; starting it again on "
                           "port %d (log: %s)", self.backend, taken, self.port, self.log_path)

    def _lost_its_port(self) -> bool:
        """True when the server exited and this start's log says its address was in use."""
        if self.alive():
            return False
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return _PORT_TAKEN in f.read().decode("utf-8", "replace").lower()
        except OSError:
            return False

    def _launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env(self.cfg), **self.env}
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            log.write(
                f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.command())}\n".encode()
            )
            log.flush()
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # own process group: stop() reaches its children too
                preexec_fn=_kill_with_parent if self.die_with_parent else None,
            )

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = self._proc.poll() if self._proc is not None else -1
            if code is not None:
                raise EngineLaunchError(
                    f"the {self.backend} engine server exited with code {code} before it became healthy "
                    f"(log: {self.log_path}):\n{self.log_tail()}"
                )
            if self.healthy(timeout_s=2.0):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise EngineLaunchError(
                    f"the {self.backend} engine server at {self.url} was not healthy after {timeout_s:.0f} s "
                    f"(log: {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """True when the process runs and GET /health answers 200."""
        if not self.alive():
            return False
        try:
            with _NO_PROXY.open(self.url + "/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> Optional[int]:
        """SIGTERM the process group, SIGKILL after ``grace_s``; returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait(10)
        else:
            self._signal_group(proc, signal.SIGKILL)  # the leader is gone; reap stragglers in its group
        return proc.returncode

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "EngineProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
