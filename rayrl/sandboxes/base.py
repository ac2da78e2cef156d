"""The Sandbox protocol every backend implements, its result type, its errors, and a picklable handle.

An episode runs untrusted, model-written commands; everything it touches goes through this small surface
(exec, write_file, read_file, reset, close) so that the rollout code never depends on how isolation is
done. A :class:`SandboxHandle` names a live sandbox so that a process other than the one that created it
(the pool actor creates, the rollout worker uses) can reopen it with ``open_sandbox`` (factory.py) and
run commands itself: commands never travel through the pool actor. This module imports no backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rayrl.config import SandboxConfig

# Default cap on the captured stdout and stderr of one exec, each; the rest is counted and dropped so a
# runaway command cannot exhaust the caller's memory or a model's context.
DEFAULT_MAX_OUTPUT_BYTES = 1_000_000


class SandboxError(RuntimeError):
    """A sandbox operation failed (setup, a refused path, a dead sandbox); the message says which."""


class SandboxUnavailable(SandboxError):
    """The requested isolation cannot be provided here; the message names the missing capability."""


@dataclass(frozen=True)
class ExecResult:
    """What one command did. ``timed_out`` is authoritative: on a timeout the whole process tree was
    killed and ``exit_code`` is 137 (128 + SIGKILL). Exit by signal N is reported as 128 + N."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class SandboxHandle:
    """Everything another process on the same node needs to reopen a sandbox (picklable).

    ``root`` is the sandbox's own directory on the host (local backend) or None (e2b). ``options`` holds
    backend facts fixed at creation (resolved isolation, host uid, output cap) so every opener behaves
    exactly like the creator.
    """

    backend: str
    sandbox_id: str
    root: str | None
    config: SandboxConfig
    options: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Sandbox(Protocol):
    """An isolated place to run commands and keep files for one episode at a time."""

    @property
    def sandbox_id(self) -> str: ...

    def handle(self) -> SandboxHandle:
        """A picklable description another process can pass to ``open_sandbox`` (factory.py)."""
        ...

    def set_lease(self, lease_id: str | None) -> None:
        """Fence (pool use): from now on only handles carrying ``lease_id`` may use the sandbox."""
        ...

    def exec(
        self,
        cmd: str | list[str],
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a string goes through ``/bin/sh -c``) in the working directory; never raises for a
        failing command, only for a broken sandbox (:class:`SandboxError`)."""
        ...

    def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` (relative to the working directory); escapes are refused."""
        ...

    def read_file(self, path: str) -> bytes:
        """Read the file at ``path`` (relative to the working directory); escapes are refused."""
        ...

    def reset(self) -> None:
        """Kill everything running and restore a fresh working directory (used between leases)."""
        ...

    def close(self) -> None:
        """Kill everything running and release the sandbox; safe to call twice."""
        ...

    def __enter__(self) -> "Sandbox": ...

    def __exit__(self, *exc: object) -> None: ...


def truncate_output(data: bytes, total: int, cap: int) -> str:
    """Decode captured bytes, marking how much was dropped when ``total`` exceeded ``cap``."""
    text = data[:cap].decode("utf-8", errors="replace")
    if total > cap:
        text += f"\n[rayrl: output truncated, {total - cap} more bytes dropped]"
    return text
