"""The event loop the gateway runs on outside Ray (``python -m rayrl.gateway``, the benches, the tests'
servers): uvloop where it is installed, else asyncio's.

Why: the gateway's per-call cost is mostly the event loop and aiohttp's server around a small amount of
our own work (docs/results/gateway_hot_path.md, fourth pass: ~80 µs of ~1 ms per call is the gateway's
own), and uvloop runs the same asyncio programs with a faster loop and transports. Ray already runs every
async actor (the trajectory manager, which hosts the gateway in a training run) on uvloop when it is
installed (``ray._private.async_compat``, ``RAY_USE_UVLOOP``); the standalone hosts use this module so a
gateway outside Ray runs on the same loop as one inside it. ``RAYRL_USE_UVLOOP=0`` (Ray's is honoured
too) runs asyncio's loop instead, to compare or to rule the loop out.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def uvloop_wanted() -> bool:
    """uvloop is importable and neither ``RAYRL_USE_UVLOOP`` nor ``RAY_USE_UVLOOP`` turns it off."""
    if any(os.environ.get(name, "1").strip().lower() in ("0", "false", "no")
           for name in ("RAYRL_USE_UVLOOP", "RAY_USE_UVLOOP")):
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop of the kind :func:`uvloop_wanted` chooses."""
    if uvloop_wanted():
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on :func:`new_event_loop`'s loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
