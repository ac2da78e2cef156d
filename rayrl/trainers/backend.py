"""What a trainer rank asks of its backend: the one protocol the torch and Megatron backends implement.

A trainer rank (actors/trainer.py ``TrainerRank``, and the offload/onload order in
rayrl/trainers/process_groups.py) holds its backend only as a :class:`TrainerBackend` and calls nothing
else on it. tests/trainers/test_trainer_backend.py holds the signatures of ``TorchTrainer`` and
``MegatronTrainer`` to this class (names, kinds, defaults and type hints of every parameter) and reads
the rank's code for every attribute it touches on its backend, so a call one backend lacks (the
``save_checkpoint(..., as_rank=...)`` that made every Megatron run end in a trainer failure) fails a
test on CPU instead of at the end of a run on a GPU.

The backends are one table, :data:`TRAINER_BACKENDS` (``trainer.backend`` -> a :class:`TrainerBackendKind`
with its traits); the config's checks (rayrl/resolve.py) and the trainer group (actors/trainer.py) ask the
traits, never the name. A new backend is one module implementing :class:`TrainerBackend` and one row.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol, Sequence

import numpy as np

from rayrl.rl.updates import UpdatePlan
from rayrl.types import Sample

if TYPE_CHECKING:  # in hints only: the config's checks read the table before Ray starts, in the driver, where
    import torch  # torch is never needed (and takes seconds to import)


class TrainerBackend(Protocol):
    """One rank's trainer: trains, hands out its weights, checkpoints, and lends its device memory."""

    policy_version: int  # updates applied so far: the label of the weights it pushes and checkpoints

    def train_step(self, samples: list[Sample], advantages: Sequence[float | np.ndarray],
                   plan: Optional[UpdatePlan] = None) -> dict[str, Any]:
        """Train one rollout batch as ``plan`` says (its mini-batches and epochs); the step's metrics."""
        ...

    def named_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights for the engines, cast to ``dtype`` (with ``trainer.lora``: the adapter alone, under
        PEFT's names); every rank iterates to the end (Megatron gathers over tensor and pipeline parallel
        ranks while it yields)."""
        ...

    def adapter_config(self) -> dict[str, Any]:
        """With ``trainer.lora``: the adapter's adapter_config.json, which the engines' LoRA route takes beside
        the tensors :meth:`named_weights` yields (ValueError without an adapter)."""
        ...

    def export_adapter(self, directory: str | Path) -> Path:
        """With ``trainer.lora``: the adapter in PEFT's own format (ValueError without an adapter)."""
        ...

    def export_merged(self, directory: str | Path, dtype: Optional[torch.dtype] = None) -> Path:
        """The policy as a plain HF model (with ``trainer.lora``, the adapter merged into the weights)."""
        ...

    def save_checkpoint(self, directory: str | Path, as_rank: Optional[int] = None) -> None:
        """This rank's part of a checkpoint in ``directory``; ``as_rank``: write the file of that rank
        instead (a surviving rank writing the whole checkpoint, where every rank holds the full state)."""
        ...

    def load_checkpoint(self, directory: str | Path) -> None:
        """Weights, optimizer state, policy version and RNG states back from ``directory``."""
        ...

    def offload(self) -> bool:
        """Release the device memory (contents kept); False where nothing moves."""
        ...

    def onload(self) -> bool:
        """Map it back, contents restored; False where nothing moves."""
        ...


@dataclass(frozen=True)
class TrainerBackendKind:
    """One trainer backend and its traits (a row of :data:`TRAINER_BACKENDS`).

    ``implementation``: ``module:Class`` of its :class:`TrainerBackend`, imported when a rank builds it
    (Megatron's module needs megatron-core). ``model_parallel``: tensor/pipeline/context parallel sizes
    above 1; its ranks form a torch.distributed world even alone, and every rank takes part in a weight
    export (gathers over the model-parallel ranks). ``full_state_on_every_rank``: one rank's files are a
    whole checkpoint (data parallel only). ``extra_kwargs``: what its constructor takes beyond the common
    ones. ``trains_lora``: it trains LoRA adapters (``trainer.lora``). ``memory_standin``: it runs
    ``trainer.memory_saver_standin`` (the CPU stand-in for torch_memory_saver).
    """

    name: str
    implementation: str
    model_parallel: bool = False
    full_state_on_every_rank: bool = True
    extra_kwargs: tuple[tuple[str, Any], ...] = ()
    trains_lora: bool = False
    memory_standin: bool = False

    def backend_class(self) -> type:
        """The class that implements it (imported now)."""
        module, _, name = self.implementation.partition(":")
        return getattr(importlib.import_module(module), name)


TRAINER_BACKENDS: dict[str, TrainerBackendKind] = {kind.name: kind for kind in (
    TrainerBackendKind("torch", "rayrl.trainers.torch_backend:TorchTrainer", trains_lora=True, memory_standin=True),
    # megatron-core 0.15.3 and mbridge 0.15.1 have no LoRA adapters; one GPU per rank (local_rank 0 under Ray)
    TrainerBackendKind("megatron", "rayrl.trainers.megatron_backend:MegatronTrainer", model_parallel=True,
                       full_state_on_every_rank=False, extra_kwargs=(("local_rank", 0),)),
)}


def trainer_backend(name: str) -> TrainerBackendKind:
    """The row ``name`` (``trainer.backend``, whose Literal type lists these); ValueError naming the choices."""
    try:
        return TRAINER_BACKENDS[name]
    except KeyError:
        raise ValueError(f"trainer.backend: {name!r} is not one of {', '.join(TRAINER_BACKENDS)}") from None
