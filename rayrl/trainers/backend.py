"""What a trainer rank asks of its backend: the one protocol the torch and Megatron backends implement.

A trainer rank (actors/trainer.py ``TrainerRank``, and the offload/onload order in
rayrl/trainers/process_groups.py) holds its backend only as a :class:`TrainerBackend` and calls nothing
else on it. tests/test_trainer_backend.py holds the signatures of ``TorchTrainer`` and
``MegatronTrainer`` to this class (names, kinds, defaults and type hints of every parameter) and reads
the rank's code for every attribute it touches on its backend, so a call one backend lacks (the
``save_checkpoint(..., as_rank=...)`` that made every Megatron run end in a trainer failure) fails a
test on CPU instead of at the end of a run on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch

from rayrl.rl.updates import UpdatePlan
from rayrl.types import Sample


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
