"""The CPU engine backend: ``python -m rayrl.engines.cpu`` (rayrl/engines/cpu/engine.py).

It serves SGLang's API plus ``/set_weight_format`` and opens rayrl's own shared-memory weight buffers
(``/get_server_info`` ``weight_buffers``), and runs wherever torch does; tests run every client path
against it.
"""

from __future__ import annotations

import sys

from rayrl.config import EngineConfig
from rayrl.engines.backends.base import EngineBackend


def cpu_server_command(
    cfg: EngineConfig, model_path: str, port: int, python: str = sys.executable, weight_version: str = "0"
) -> list[str]:
    """``python -m rayrl.engines.cpu ...`` for ``cfg``."""
    return [
        python, "-m", "rayrl.engines.cpu",
        "--model-path", str(model_path),
        "--host", cfg.host,
        "--port", str(port),
        "--dtype", cfg.dtype,
        "--max-batch-size", str(cfg.max_batch_size),
        "--context-length", str(cfg.context_length),
        "--num-threads", str(cfg.num_threads),
        "--prefix-cache-mb", str(cfg.prefix_cache_mb),
        "--tp-size", str(cfg.tp_size),
        "--weight-format", cfg.weight_format,
        "--weight-version", str(weight_version),
        *(["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank)] if cfg.max_lora_rank else []),
        *(["--lora-target-modules", *cfg.lora_target_modules] if cfg.max_lora_rank and cfg.lora_target_modules
          else []),
        *cfg.extra_args,
    ]  # fmt: skip


CPU = EngineBackend(
    name="cpu",
    command=cpu_server_command,
    weight_formats=("float32", "fp16-packed"),
    extra_routes={"/set_weight_format": "POST"},  # rayrl/engines/cpu/server.py
    serves_lora=True,
)
