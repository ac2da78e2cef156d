"""A gateway shard in a process of its own (``python -m rayrl.gateway serve``), for the benches that drive one
over HTTP (bench/gateway_soak.py, bench/session_capacity.py).

Its output is read to the end on a thread of the bench: a pipe nobody reads holds 64 KB, after which the
gateway's next log line blocks its event loop, and with it every session, until the bench gives up.
The last lines are kept for the error when it fails to start or the bench wants to show them.
"""

from __future__ import annotations

import collections
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
READY = "rayrl gateway at"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GatewayOutput:
    """The gateway's output lines, drained as they come; the last ``keep`` kept."""

    def __init__(self, proc: subprocess.Popen, keep: int = 200) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.count = 0
        self._thread = threading.Thread(target=self._drain, args=(proc,), name="gateway-output", daemon=True)
        self._thread.start()

    def _drain(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))
            self.count += 1


class GatewayProcess(NamedTuple):
    proc: subprocess.Popen
    root: str  # http://127.0.0.1:PORT
    output: GatewayOutput


def start_gateway(model_dir: Path, engine_url: str, env: dict[str, str], admin_token: str = "admin",
                  log_level: str = "WARNING") -> GatewayProcess:
    """Start a gateway in front of ``engine_url``; returns once it says it listens. Its output keeps being
    read (``output``)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rayrl.gateway", "serve", "--model", str(model_dir),
                             "--engine-url", engine_url, "--port", str(port), "--admin-token", admin_token,
                             "--log-level", log_level], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=REPO)
    before: list[str] = []
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith(READY):
            break
        before.append(line)
    else:
        proc.wait(30)
        raise RuntimeError(f"the gateway exited {proc.returncode} before it listened:\n{''.join(before[-40:])}")
    return GatewayProcess(proc, f"http://127.0.0.1:{port}", GatewayOutput(proc))
