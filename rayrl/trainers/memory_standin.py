"""A stand-in for torch_memory_saver's pause on CPU: offloaded weights cannot be read until onload.

On a GPU, ``trainer.offload()`` (rayrl/trainers/memory_saver.py) unmaps the physical memory behind the
trainer's parameters: the tensors keep their addresses, and a kernel that reads them before ``onload``
fails with an illegal memory access. On CPU the saver does nothing, so a schedule that reads the weights
after offloading them (a weight push after offload) passes every CPU test and fails on the first GPU
step. With ``trainer.memory_saver_standin`` the torch backend on CPU uses :class:`UnmappedStandIn`
instead: ``pause`` moves every parameter and buffer to the ``meta`` device (the values kept aside), so any
read of their values raises, as the GPU would; ``resume`` puts them back, bit for bit. Tests only.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from rayrl.trainers.memory_saver import MemorySaver

logger = logging.getLogger(__name__)


class UnmappedStandIn(MemorySaver):
    """An inactive MemorySaver (nothing allocated differently) whose pause makes the weights unreadable."""

    def __init__(self, module: Callable[[], torch.nn.Module]) -> None:
        super().__init__(enabled=False, tag="standin")
        self._module = module
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        logger.info("memory saver stand-in (CPU): offloaded weights are unreadable until onload")

    def pause(self) -> bool:
        if self.paused:
            return False
        module = self._module()
        for tensor in [*module.parameters(), *module.buffers()]:
            unmapped = torch.empty_like(tensor, device="meta")
            torch.utils.swap_tensors(tensor, unmapped)  # the same Python object (optimizer, module) now on meta
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
