"""Running real episodes without Ray: the two services EpisodeRunner needs, in process.

A notebook or a test can drive rayrl.agents.episode.EpisodeRunner with these instead of the Ray actors:
sessions on a gateway that runs on the test's event loop thread, and a fresh local sandbox per episode.
"""

from __future__ import annotations

from typing import Any

from rayrl.config import SandboxConfig
from rayrl.sandboxes.local import LocalSandbox


class InProcessSessions:
    """The SessionService protocol over a gateway on the test's loop (what the Ray actor does remotely)."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack

    def open_session(self, metadata: dict[str, Any]) -> Any:
        return self.stack.gateway.open_session(metadata)

    def session_stats(self, session_id: str) -> dict[str, Any]:
        return self.stack.gateway.session_stats(session_id)

    def finish_session(self, session_id: str, reward: float, metadata: dict[str, Any] | None = None) -> list:
        return self.stack.loop.run(self.stack.gateway.finish_session(session_id, reward, metadata))


class LocalSandboxes:
    """A fresh local sandbox per episode (the pool's job in a run), under the default sandbox root."""

    def __init__(self) -> None:
        self.leased: dict[str, LocalSandbox] = {}

    def acquire(self) -> tuple[str, LocalSandbox]:
        sandbox = LocalSandbox(SandboxConfig(timeout_s=10))
        lease = f"lease-{len(self.leased)}"
        self.leased[lease] = sandbox
        return lease, sandbox

    def release(self, lease_id: str) -> None:
        self.leased.pop(lease_id).close()
