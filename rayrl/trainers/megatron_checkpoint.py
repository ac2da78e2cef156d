"""The Megatron trainer's checkpoint: model and optimizer through megatron-core's dist_checkpointing, plus
the trainer's counters and every rank's RNG states.

The state goes in as Megatron's sharded state dict: each model chunk's ``sharded_state_dict`` taken from
the bare model inside its wrappers (their keys are the ones ``load_state_dict`` expects), and the
optimizer's, built over the merged model state. A load must tell the optimizer it is loading
(``is_loading=True``): a fresh optimizer has no Adam moments yet, and only for a load does Megatron build
their layout (its ``init_state_fn``; the distributed optimizer's load layout also differs from a save's),
so without it the moments would silently not come back.

Where this runs: megatron-core 0.15.3 needs CUDA for it. Its save synchronizes the device unconditionally
(dist_checkpointing/strategies/filesystem_async.py ``preload_tensors`` is called with
``non_blocking=True`` and calls ``torch.cuda.synchronize()``), and every one of its optimizers makes CUDA
tensors when built (optimizer/optimizer.py: ``FP32Optimizer.__init__`` ``torch.tensor([1.0],
device='cuda')``; the mixed-precision ones likewise). The round trip is tested on a GPU
(tests/gpu/test_gpu_megatron_local.py, scripts/gpu_validate.sh).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def bare_model(module: Any) -> Any:
    """The bare model inside its wrappers (DDP, Float16Module), whose ``sharded_state_dict`` keys are the
    ones ``load_state_dict`` expects (the wrappers forward it to the bare model). DDP is a MegatronModule
    too: its own ``sharded_state_dict`` walks its children and prefixes every key with ``module.``."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def sharded_state(model: list[Any], optimizer: Any, is_loading: bool) -> dict[str, Any]:
    """Model chunks and optimizer as Megatron distributed-checkpoint state."""
    state: dict[str, Any] = {f"model{i}": bare_model(m).sharded_state_dict() for i, m in enumerate(model)}
    merged: dict[str, Any] = {}
    for i in range(len(model)):
        merged.update(state[f"model{i}"])
    state["optimizer"] = optimizer.sharded_state_dict(merged, is_loading=is_loading)
    return state


def save(directory: Path, model: list[Any], optimizer: Any, rank: int, counters: dict[str, int]) -> None:
    """Every rank together (a collective): the distributed checkpoint under ``directory/megatron``, this
    rank's RNG states, and on rank 0 the trainer's ``counters``."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    (directory / "megatron").mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded_state(model, optimizer, is_loading=False), str(directory / "megatron"))
    rng = {"torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(), "python_rng": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda_rng"] = torch.cuda.get_rng_state()
    torch.save(rng, directory / f"rng_rank{rank}.pt")
    if rank == 0:
        (directory / "trainer_state.json").write_text(json.dumps(counters))
    dist.barrier()


def load(directory: Path, model: list[Any], optimizer: Any, rank: int) -> dict[str, int]:
    """Model and optimizer back in place (moments included), this rank's RNG states; the counters."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(sharded_state(model, optimizer, is_loading=True), str(directory / "megatron"))
    for i, m in enumerate(model):
        bare_model(m).load_state_dict(loaded[f"model{i}"])
    optimizer.load_state_dict(loaded["optimizer"])
    rng_file = directory / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch_rng"])
        if "cuda_rng" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda_rng"])
        np.random.set_state(rng["numpy_rng"])
        random.setstate(rng["python_rng"])
    return {k: int(v) for k, v in json.loads((directory / "trainer_state.json").read_text()).items()}
