"""Sandboxes: isolated places where episodes run model-written commands.

``create_sandbox(config)`` makes one (local: bubblewrap/unshare namespaces; e2b: a cloud sandbox);
``open_sandbox(handle)`` reopens one in another process on the same node; ``SandboxPool`` keeps warm
sandboxes and leases them to episodes (the ``SandboxPoolActor`` wraps it in Ray).
"""

from rayrl.sandboxes.base import (
    DEFAULT_MAX_OUTPUT_BYTES,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxHandle,
    SandboxUnavailable,
)
from rayrl.sandboxes.factory import create_sandbox, open_sandbox
from rayrl.sandboxes.pool import Lease, PoolClosed, PoolExhausted, SandboxPool

__all__ = [
    "DEFAULT_MAX_OUTPUT_BYTES",
    "ExecResult",
    "Lease",
    "PoolClosed",
    "PoolExhausted",
    "Sandbox",
    "SandboxError",
    "SandboxHandle",
    "SandboxPool",
    "SandboxUnavailable",
    "create_sandbox",
    "open_sandbox",
]
