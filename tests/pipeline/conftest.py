"""Fixtures for the pipeline tests: a real CPU engine server on loopback (tiny random model)."""

from __future__ import annotations

from typing import Iterator

import pytest

from rayrl.engines.cpu.engine import CPUEngine
from tests.engines._engine_kit import ServerThread


@pytest.fixture
def engine_server(tiny_model_dir) -> Iterator[ServerThread]:
    """A real EngineServer over a CPUEngine, on its own event loop in a daemon thread."""
    engine = CPUEngine(str(tiny_model_dir), dtype="float32", max_batch_size=8, weight_version="0").start()
    server = ServerThread(engine)
    yield server
    server.close()
    engine.shutdown()
