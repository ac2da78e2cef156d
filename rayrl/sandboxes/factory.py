"""Which class makes each sandbox provider: ``create_sandbox`` and ``open_sandbox`` over one table.

Its own module, apart from base.py (the protocol the providers implement), so that the protocol never
imports its implementations: local.py and e2b.py import base.py, this module imports them. A new
provider is one module implementing :class:`~rayrl.sandboxes.base.Sandbox` (with ``attach``) and one row
in :data:`PROVIDERS` (and its name in ``SandboxConfig.backend``'s Literal type); nothing else compares a
provider's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from rayrl.config import SandboxConfig
from rayrl.sandboxes.base import Sandbox, SandboxError, SandboxHandle
from rayrl.sandboxes.e2b import E2BSandbox
from rayrl.sandboxes.local import LocalSandbox, remove_orphans


@dataclass(frozen=True)
class SandboxProvider:
    """One sandbox provider (``sandbox.backend``) and its traits.

    ``cls`` creates one (``cls(config)``, with ``root=`` where ``host_root``) and reopens one
    (``cls.attach(handle)``). ``host_root``: its sandboxes keep a directory on the host, under ``root``
    (default: the node-wide rayrl-sandboxes directory). ``sweep_orphans(root)``: removes what a pool that
    crashed left on this node; a pool runs it when it starts.
    """

    name: str
    cls: type
    host_root: bool = False
    sweep_orphans: Optional[Callable[[Optional[str]], int]] = None


PROVIDERS: dict[str, SandboxProvider] = {provider.name: provider for provider in (
    SandboxProvider("local", LocalSandbox, host_root=True, sweep_orphans=remove_orphans),
    SandboxProvider("e2b", E2BSandbox),
)}


def sandbox_provider(name: str) -> SandboxProvider:
    """The row ``name``; SandboxError naming the choices."""
    try:
        return PROVIDERS[name]
    except KeyError:
        raise SandboxError(f"sandbox.backend: unknown backend {name!r} (expected one of {', '.join(PROVIDERS)})") \
            from None


def create_sandbox(config: SandboxConfig, root: str | None = None) -> Sandbox:
    """Create a new sandbox of ``config.backend``; the caller owns it and must close it. ``root``: where a
    provider with ``host_root`` keeps its directory on the host (the others keep nothing there)."""
    provider = sandbox_provider(config.backend)
    return provider.cls(config, root=root) if provider.host_root else provider.cls(config)


def open_sandbox(handle: SandboxHandle) -> Sandbox:
    """Reopen a sandbox created elsewhere (e.g. by the pool actor) in this process.

    Commands run from the caller's process. Closing the returned object stops only what this process
    started; the creator (the pool) keeps ownership of the sandbox's lifetime and files.
    """
    if handle.backend not in PROVIDERS:
        raise SandboxError(f"unknown sandbox backend {handle.backend!r} in handle {handle.sandbox_id}")
    return PROVIDERS[handle.backend].cls.attach(handle)
