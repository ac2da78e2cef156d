"""An asyncio loop in a thread of its own, for tests whose sync clients call servers it runs."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable


class LoopThread:
    """An asyncio loop in a daemon thread, so sync clients (openai SDK) can call servers it runs; ``new_loop``
    makes it (the gateway stacks pass rayrl.gateway.event_loop's, the loop Ray would host them on)."""

    def __init__(self, new_loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop) -> None:
        self.loop = new_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
