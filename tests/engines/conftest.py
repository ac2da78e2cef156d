"""Fixtures for the engine tests: in-process engines and real HTTP servers over the tiny model
(``tiny_model``: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch
from _engine_kit import ServerThread

from rayrl.engines.cpu.engine import CPUEngine


@pytest.fixture(scope="session")
def reference_model(tiny_model):
    """The same weights in a plain transformers model (stock attention, float32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def _engine(path: Path, **kw) -> CPUEngine:
    return CPUEngine(path, dtype="float32", max_batch_size=8, weight_version="0", **kw).start()


@pytest.fixture(scope="session")
def engine(tiny_model) -> Iterator[CPUEngine]:
    """A float32 engine shared by tests that neither change its weights nor pause it."""
    eng = _engine(tiny_model)
    yield eng
    eng.shutdown()


@pytest.fixture
def fresh_engine(tiny_model) -> Iterator[CPUEngine]:
    """A private engine for tests that update weights or pause."""
    eng = _engine(tiny_model)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[ServerThread]:
    """A real HTTP engine server on loopback over a private float32 engine."""
    eng = _engine(tiny_model)
    st = ServerThread(eng)
    yield st
    st.close()
    eng.shutdown()
