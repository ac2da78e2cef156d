"""Fixtures for the pipeline tests: a real CPU engine server on loopback (tiny random model)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Iterator

import pytest

from rayrl.engines.cpu_engine import CPUEngine
from rayrl.engines.server import EngineServer


class EngineThread:
    """A real EngineServer over a CPUEngine, on its own event loop in a daemon thread."""

    def __init__(self, model_dir: str) -> None:
        self.engine = CPUEngine(model_dir, dtype="float32", max_batch_size=8, weight_version="0").start()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = EngineServer(self.engine, host="127.0.0.1", port=0)
        self.url = self.run(self.server.start())

    def run(self, coro: Awaitable[Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.engine.shutdown()


@pytest.fixture
def engine_server(tiny_model_dir) -> Iterator[EngineThread]:
    server = EngineThread(str(tiny_model_dir))
    yield server
    server.close()
