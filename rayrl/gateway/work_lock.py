"""The gateway's lock for pieces of request work (:attr:`Gateway.cpu`), with a free path that costs a check.

Why the lock exists (app.py): the CPU work of LLM calls (decoding and rendering a request, parsing and
recording its answer, one streamed chunk's deltas) and finishing sessions runs one piece at a time, and
pieces that find it taken wait their turn in order (first come, first served), each in a later turn of
the event loop, after the sockets have been polled again. :class:`asyncio.Lock` gives that order.

Every piece is synchronous: it holds the lock without awaiting. So a piece that finds the lock free with
nobody waiting for it runs to its end before anything else on the loop can look at the lock, exactly as
when it takes and lets go of an :class:`asyncio.Lock` (whose ``acquire`` returns without suspending then).
:meth:`WorkLock.run` does that case with a check instead of the lock's coroutines (``__aenter__``,
``acquire``, ``__aexit__``, ``release`` and its wake-up: a dozen Python calls and three coroutine objects
per LLM call, in three pieces); a piece that finds the lock held, or others queued for it, takes it
through :class:`asyncio.Lock` and waits in order behind them, as before. A queue forms only while the
lock is held across an await (tests/gateway/test_health_first.py holds it so), or while a waiter has been
handed the lock and has not run yet: the free path then does not jump it (tests/gateway/test_work_lock.py).
"""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

T = TypeVar("T")


class WorkLock(asyncio.Lock):
    """:class:`asyncio.Lock` (so ``async with``, ``acquire`` and ``release`` work as ever) plus :meth:`run`."""

    async def run(self, work: Callable[[], T]) -> T:
        """``work()`` (synchronous) as one piece under the lock: at once when the lock is free and nobody is
        queued for it, else after those ahead of it."""
        if not self._locked and not self._waiters:  # asyncio.Lock's own state (3.10-3.13): free, no queue
            return work()
        async with self:
            return work()
