"""A stand-in for torch_memory_saver's pause on CPU: offloaded trainer memory cannot be read or written
until onload.

On a GPU, ``trainer.offload()`` (rayrl/trainers/memory_saver.py) unmaps the physical memory behind the
trainer's parameters, gradients and optimizer state: the tensors keep their addresses, and any kernel
that reads or writes them before ``onload`` fails with an illegal memory access. On CPU the saver does
nothing, so a schedule that touches the trainer while it is offloaded (a weight push, a checkpoint save,
a checkpoint load, an export) passes every CPU test and fails on the first GPU step. With
``trainer.memory_saver_standin`` the torch backend on CPU uses :class:`UnmappedStandIn` instead: ``pause``
swaps every parameter, buffer (policy and reference model) and optimizer state tensor for an
:class:`UnmappedTensor` of the same shape, the values kept aside, so every operation on them raises
:class:`OffloadedMemoryError` (a read: an export, ``torch.save``; a write: ``load_state_dict``'s copy);
``resume`` puts them back, bit for bit. Tests only.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

import torch

from rayrl.trainers.memory_saver import MemorySaver

logger = logging.getLogger(__name__)


class OffloadedMemoryError(RuntimeError):
    """An operation touched trainer memory while it was offloaded (on a GPU: an illegal memory access)."""


class UnmappedTensor(torch.Tensor):
    """A tensor whose memory is unmapped: its shape, dtype and device can be read (as on a GPU, where the
    tensor object survives a pause), any operation on its values raises, and so does pickling it."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> "UnmappedTensor":
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                                   device=like.device, requires_grad=like.requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise OffloadedMemoryError(
            f"{func} on trainer memory that is offloaded (trainer.offload() without trainer.onload()); on a "
            "GPU this reads or writes unmapped memory: an illegal memory access")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OffloadedMemoryError("saving trainer memory that is offloaded (trainer.offload() without "
                                   "trainer.onload()); on a GPU this reads unmapped memory")


class UnmappedStandIn(MemorySaver):
    """An inactive MemorySaver (nothing allocated differently) whose pause makes the trainer's memory
    unusable: the modules' parameters and buffers and the optimizer's per-parameter state (its 0-d ``step``
    counters stay readable: torch keeps them on the host unless fused or capturable)."""

    def __init__(self, modules: Callable[[], Iterable[Optional[torch.nn.Module]]],
                 optimizer: Callable[[], Optional[torch.optim.Optimizer]] = lambda: None) -> None:
        super().__init__(enabled=False, tag="standin")
        self._modules = modules
        self._optimizer = optimizer
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        logger.info("memory saver stand-in (CPU): offloaded trainer memory is unusable until onload")

    def _tensors(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for module in self._modules():
            if module is not None:
                for tensor in [*module.parameters(), *module.buffers()]:
                    seen.setdefault(id(tensor), tensor)
        optimizer = self._optimizer()
        if optimizer is not None:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        seen.setdefault(id(value), value)
        return list(seen.values())

    def pause(self) -> bool:
        if self.paused:
            return False
        for tensor in self._tensors():
            unmapped = UnmappedTensor(tensor)
            torch.utils.swap_tensors(tensor, unmapped)  # the same Python object (optimizer, module) now unmapped
            self._kept.append((tensor, unmapped))
        self.paused = True
        return True

    def resume(self) -> bool:
        if not self.paused:
            return False
        for tensor, kept in self._kept:
            torch.utils.swap_tensors(tensor, kept)
        self._kept.clear()
        self.paused = False
        return True
