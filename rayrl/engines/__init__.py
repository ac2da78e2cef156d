"""Inference engines behind SGLang's native HTTP API.

- ``client.EngineClient`` / ``router.Router``: what callers use (SGLang on GPU, the CPU engine here).
- ``cpu/``: rayrl's own CPU engine (``CPUEngine`` + ``EngineServer``, ``python -m rayrl.engines.cpu``): a
  transformers model with continuous batching, serving the same endpoints as SGLang; ``vllm/``: the vllm
  backend's adapter in front of a real vLLM. Each is a package of its own; this level is the
  engine-agnostic client side.
- ``launcher.EngineProcess``: one engine server as a managed subprocess; ``backends``: what differs
  between servers (launch command, environment, GPUs, weight wire), one table.
- ``api.EngineAPI``: the HTTP API every backend serves, as a typed protocol.

Names are imported lazily so that using the client does not import torch/transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineClient": "client",
    "EngineError": "client",
    "EngineUnavailable": "client",
    "GenerateOutput": "client",
    "Router": "router",
    "CPUEngine": "cpu.engine",
    "GenerationResult": "cpu.engine",
    "SamplingParams": "cpu.sampling",
    "EngineServer": "cpu.server",
    "EngineProcess": "launcher",
    "EngineLaunchError": "launcher",
    "cpu_server_command": "backends.cpu",
    "sglang_command": "backends.sglang",
    "EngineBackend": "backends",
    "engine_backend": "backends",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"rayrl.engines.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'rayrl.engines' has no attribute {name!r}")
