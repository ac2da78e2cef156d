"""The event loop a gateway runs on: uvloop where it is installed, the one Ray gives its async actors.

Why: the GatewayShard actor hosts the gateway on the loop Ray makes for async actors, and Ray makes a
uvloop loop whenever uvloop is importable and ``RAY_USE_UVLOOP`` does not turn it off
(``ray._private.async_compat.get_new_event_loop``). The standalone host (``python -m rayrl.gateway``), the
benches and the tests' gateway stacks use :func:`new_event_loop` so they run the gateway on that same loop,
and what they measure and check is what a training run serves with. On uvloop the per-read and per-write
work of the loop and its socket transports (a streamed answer from the engine arrives in one read per
token) is C instead of Python (docs/results/gateway_hot_path.md, ninth pass).

The rule is Ray's, not ours: uvloop when importable, unless ``RAY_USE_UVLOOP`` is set to anything but
``1``/``true`` (any case); asyncio's own loop otherwise.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def uses_uvloop() -> bool:
    """Whether :func:`new_event_loop` makes a uvloop loop (Ray's rule for its async actors)."""
    value = os.environ.get("RAY_USE_UVLOOP")
    if value is not None and value.lower() not in ("1", "true"):
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the kind Ray runs its async actors on (see :func:`uses_uvloop`)."""
    if uses_uvloop():
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a loop from :func:`new_event_loop`."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
