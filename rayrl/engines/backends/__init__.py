"""The engine backends, one table: ``engine.backend`` -> the :class:`EngineBackend` that owns its launch
command, environment, GPU accounting, default dtype, weight wire and the routes it adds.

A new server (vLLM, say) is one module here defining its ``EngineBackend`` and one row in
:data:`BACKENDS` (docs/architecture.md lists the rest it touches). Nothing else in rayrl or actors/
compares backend names.
"""

from __future__ import annotations

from rayrl.engines.backends.base import EngineBackend
from rayrl.engines.backends.cpu import CPU
from rayrl.engines.backends.sglang import SGLANG
from rayrl.engines.backends.vllm import VLLM, VLLM_CPU

BACKENDS: dict[str, EngineBackend] = {backend.name: backend for backend in (CPU, SGLANG, VLLM, VLLM_CPU)}
AUTO = {False: CPU.name, True: SGLANG.name}  # engine.backend: auto -> by whether the machine has CUDA


def engine_backend(name: str) -> EngineBackend:
    """The backend called ``name`` (a resolved ``engine.backend``); ValueError naming the choices."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"engine.backend: {name!r} is not one of {', '.join(BACKENDS)}") from None


def auto_backend(cuda: bool) -> str:
    """What ``engine.backend: auto`` becomes on a machine with or without CUDA."""
    return AUTO[cuda]


__all__ = ["AUTO", "BACKENDS", "EngineBackend", "auto_backend", "engine_backend"]
