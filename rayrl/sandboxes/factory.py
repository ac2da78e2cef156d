"""Which class makes each sandbox backend: ``create_sandbox`` and ``open_sandbox`` over one table.

Its own module, apart from base.py (the protocol the backends implement), so that the protocol never
imports its implementations: local.py and e2b.py import base.py, this module imports them. A new
provider is one module implementing :class:`~rayrl.sandboxes.base.Sandbox` (with ``attach``) and one row
in :data:`BACKENDS`.
"""

from __future__ import annotations

from rayrl.config import SandboxConfig
from rayrl.sandboxes.base import Sandbox, SandboxError, SandboxHandle
from rayrl.sandboxes.e2b import E2BSandbox
from rayrl.sandboxes.local import LocalSandbox

# sandbox.backend -> the class that creates one (``cls(config, root=...)``) and reopens one (``cls.attach``)
BACKENDS: dict[str, type] = {"local": LocalSandbox, "e2b": E2BSandbox}


def create_sandbox(config: SandboxConfig, root: str | None = None) -> Sandbox:
    """Create a new sandbox of ``config.backend``; the caller owns it and must close it. ``root``: where
    the local backend keeps its directory on the host (the others keep nothing there)."""
    cls = BACKENDS.get(config.backend)
    if cls is None:
        raise SandboxError(
            f"sandbox.backend: unknown backend {config.backend!r} (expected one of {', '.join(BACKENDS)})"
        )
    return cls(config, root=root) if cls is LocalSandbox else cls(config)


def open_sandbox(handle: SandboxHandle) -> Sandbox:
    """Reopen a sandbox created elsewhere (e.g. by the pool actor) in this process.

    Commands run from the caller's process. Closing the returned object stops only what this process
    started; the creator (the pool) keeps ownership of the sandbox's lifetime and files.
    """
    cls = BACKENDS.get(handle.backend)
    if cls is None:
        raise SandboxError(f"unknown sandbox backend {handle.backend!r} in handle {handle.sandbox_id}")
    return cls.attach(handle)
