"""EngineBackend: everything that differs between inference servers, in one object per server.

The rest of rayrl talks to every engine the same way (the HTTP API in rayrl/engines/api.py, through
``EngineClient``), so what depends on *which* server runs is only: how it is launched (command and
environment), whether it sits on GPUs (Ray's accounting, the auto dtype, where weight payloads must be
made), what its weight endpoints unpickle, and the routes it adds to SGLang's API. Code that needs one of
these asks the backend (``engine_backend(cfg.engine.backend)``), never compares the name.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Mapping, Optional, Protocol

from rayrl.config import EngineConfig


class LaunchCommand(Protocol):
    def __call__(self, cfg: EngineConfig, model_path: str, port: int, python: str = sys.executable,
                 weight_version: str = "0") -> list[str]: ...


class LaunchEnv(Protocol):
    def __call__(self, cfg: EngineConfig) -> dict[str, str]: ...


class ConfigCheck(Protocol):
    def __call__(self, cfg: EngineConfig) -> None: ...


def no_env(cfg: EngineConfig) -> dict[str, str]:
    """A backend that needs nothing beyond the caller's environment."""
    return {}


@dataclass(frozen=True)
class EngineBackend:
    """One inference server kind (a row of rayrl/engines/backends/__init__.py's table).

    ``on_gpu``: its engines hold GPU memory: an engine with no shared placement asks Ray for
    ``engine.tp_size`` GPUs, ``engine.dtype: auto`` is bfloat16, and weight payloads for it are made on
    its GPUs (rayrl/weights/plan.py). ``sglang_wire``: its weight endpoints unpickle SGLang's own bucket
    classes only (rayrl/weights/wire.py), so senders must never fall back to ours. ``weight_formats``: the
    ``engine.weight_format`` values it takes beyond ``auto`` (empty: it has no such setting; its own flags
    go in ``engine.extra_args``); ``extra_routes``: the routes it serves beyond rayrl/engines/api.py's
    ``ROUTES`` (path -> method); ``check``: what the config must hold for it beyond the schema, run at
    load (``EngineConfig.__post_init__``; raises ConfigError naming the field), e.g. that the
    interpreter it runs from exists.
    ``serves_lora``: it takes a LoRA adapter as the policy's weight update and generates with it
    (``trainer.lora`` is refused at load for a backend without it).
    """

    name: str
    command: LaunchCommand
    env: LaunchEnv = no_env
    on_gpu: bool = False
    sglang_wire: bool = False
    weight_formats: tuple[str, ...] = ()
    extra_routes: Mapping[str, str] = field(default_factory=dict)
    check: Optional[ConfigCheck] = None
    serves_lora: bool = False

    @property
    def switch_weight_format(self) -> bool:
        """It serves ``POST /set_weight_format``, so the pipeline can move it to float32 when its
        log-probs drift (``engine.max_logprob_gap``)."""
        return "/set_weight_format" in self.extra_routes
