"""The SGLang backend (GPU): ``python -m sglang.launch_server`` with the memory saver, NCCL as the trainer
has it, and SGLang's own bucket classes on the weight wire. The pinned SGLang's contract is held by
tests/contracts/ and by rayrl/engines/cpu/sglang_standin.py (docs/gpu.md).

Its own options are the ``engine.sglang`` section (rayrl/config/serving.py ``SGLangConfig``), read here
only; the generic ``engine`` fields are every backend's.
"""

from __future__ import annotations

import sys

from rayrl.config import EngineConfig
from rayrl.engines.backends.base import EngineBackend

# Every process in a weight group uses NCCL the same way: SGLang sets NCCL_CUMEM_ENABLE=0 in its engines
# (entrypoints/engine.py, unless already set), so the trainer ranks set it too (actors/trainer.py) and the
# launcher sets it for the engines explicitly (sglang_env below). With cuMem on one side and off on the other,
# the trainer's NCCL buffers are cuMem allocations the engines' NCCL maps differently, and their memory is not
# what the colocated schedule's accounting expects.
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0"}


def sglang_command(
    cfg: EngineConfig, model_path: str, port: int, python: str = sys.executable, weight_version: str = "0"
) -> list[str]:
    """``python -m sglang.launch_server ...`` for ``cfg`` (GPU).

    ``--enable-memory-saver`` (``engine.sglang.enable_memory_saver``, on by default) puts the weights, KV
    cache and CUDA graphs in torch_memory_saver regions, which is what makes ``/release_memory_occupation``
    free memory for a colocated trainer. The GPUs come from CUDA_VISIBLE_DEVICES (the placement group's
    bundles), so ``--tp-size`` GPUs must be visible. ``--weight-version`` is the version the loaded checkpoint has.
    """
    return [
        python, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--tp-size", str(cfg.tp_size),
        "--mem-fraction-static", str(cfg.sglang.mem_fraction_static),
        *(["--enable-memory-saver"] if cfg.sglang.enable_memory_saver else []),
        "--dtype", cfg.dtype,
        "--context-length", str(cfg.context_length),
        "--max-running-requests", str(cfg.max_batch_size),
        "--weight-version", str(weight_version),
        "--host", cfg.host,
        "--port", str(port),
        *lora_args(cfg),
        *cfg.extra_args,
    ]  # fmt: skip


def lora_args(cfg: EngineConfig) -> list[str]:
    """With ``engine.max_lora_rank`` (trainer.lora): LoRA on, the rank and the target modules to reserve room
    for, so ``/load_lora_adapter_from_tensors`` can take the policy's adapter at every update."""
    if not cfg.max_lora_rank:
        return []
    return ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank),
            "--lora-target-modules", *(cfg.lora_target_modules or ["all"])]


def sglang_env(cfg: EngineConfig) -> dict[str, str]:
    """Environment of an SGLang engine: NCCL as the trainer ranks use it (:data:`NCCL_ENV`),
    and with the memory saver on, CUDA-graph memory in torch_memory_saver too
    (``SGLANG_MEMORY_SAVER_CUDA_GRAPH``; without it /release_memory_occupation leaves the graphs' pools
    on the GPU through every training phase)."""
    env = dict(NCCL_ENV)
    if cfg.sglang.enable_memory_saver:
        env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"
    return env


SGLANG = EngineBackend(name="sglang", command=sglang_command, env=sglang_env, on_gpu=True, sglang_wire=True,
                       serves_lora=True)
