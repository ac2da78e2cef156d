"""rayrl/gateway/work_lock.py: the gateway's work lock keeps asyncio.Lock's order; its free path only
skips the lock's coroutines when nothing could tell the difference.

An order of events, not a timing: a free lock runs the piece without suspending; a held one, or one
with a queue, runs pieces first come first served, including the moment a released lock has been
handed to a waiter that has not run yet (the free path must not jump it).
"""

from __future__ import annotations

import asyncio

import pytest

from rayrl.gateway.work_lock import WorkLock


def test_a_free_lock_runs_the_piece_without_suspending():
    lock = WorkLock()
    coro = lock.run(lambda: 42)
    with pytest.raises(StopIteration) as done:
        coro.send(None)  # finished in one step: it never yielded to an event loop
    assert done.value.value == 42 and not lock.locked()


def test_pieces_that_find_it_held_run_in_arrival_order_after_it_is_let_go():
    async def main() -> list[str]:
        lock, order = WorkLock(), []
        await lock.acquire()  # held across an await, as tests/gateway/test_health_first.py does
        tasks = [asyncio.ensure_future(lock.run(lambda name=name: order.append(name))) for name in "abc"]
        await asyncio.sleep(0)
        assert order == []
        lock.release()
        await asyncio.gather(*tasks)
        assert not lock.locked()
        return order

    assert asyncio.run(main()) == ["a", "b", "c"]


def test_the_free_path_does_not_jump_a_waiter_the_lock_was_handed_to():
    """Released with a waiter queued: the lock reads unlocked until that waiter runs, and a piece arriving
    in between still goes after it."""

    async def main() -> list[str]:
        lock, order = WorkLock(), []
        await lock.acquire()
        first = asyncio.ensure_future(lock.run(lambda: order.append("queued")))
        await asyncio.sleep(0)
        lock.release()
        assert not lock.locked()  # handed over, the waiter not yet run
        await lock.run(lambda: order.append("newcomer"))
        await first
        return order

    assert asyncio.run(main()) == ["queued", "newcomer"]


def test_a_failing_or_cancelled_piece_leaves_the_lock_usable():
    async def main() -> list[str]:
        lock, order = WorkLock(), []

        def boom() -> None:
            raise ValueError("bad request")

        with pytest.raises(ValueError):
            await lock.run(boom)
        assert not lock.locked()
        await lock.acquire()
        with_error = asyncio.ensure_future(lock.run(boom))
        cancelled = asyncio.ensure_future(lock.run(lambda: order.append("cancelled")))
        last = asyncio.ensure_future(lock.run(lambda: order.append("last")))
        await asyncio.sleep(0)
        cancelled.cancel()
        lock.release()
        with pytest.raises(ValueError):
            await with_error
        await last
        assert cancelled.cancelled() and not lock.locked()
        assert await lock.run(lambda: "free") == "free"
        return order

    assert asyncio.run(main()) == ["last"]
