"""torch_memory_saver for the trainer: parameters, gradients and optimizer state in pauseable regions.

Colocated on a GPU, the trainer gives its memory to the engines during rollout: :meth:`MemorySaver.pause`
releases the physical memory behind every tensor allocated inside :meth:`MemorySaver.region` (their
virtual addresses stay reserved), and :meth:`MemorySaver.resume` maps memory back at the same addresses,
so the model, the optimizer and any captured CUDA graph keep working without being rebuilt. With
``cpu_backup`` (the default) the contents are copied to host memory on pause and restored on resume,
bit for bit; without it they are lost (fine for buffers that are overwritten before use).

On CPU, or with the saver turned off, every method is a no-op and a single log line says why, so the
same trainer code runs everywhere.

Hook mode: torch_memory_saver intercepts CUDA allocations either by ``LD_PRELOAD`` of its hook library
(which must be set when the process starts) or through torch's pluggable allocator ("torch" mode, no
preload, but no pauseable CUDA graphs). Ray actors are not started with the preload, so "torch" is used
unless the preload library is already in ``LD_PRELOAD``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Optional

import torch

logger = logging.getLogger(__name__)


class MemorySaverUnavailable(RuntimeError):
    """The saver was asked for on a GPU, but torch_memory_saver cannot be imported."""


def _hook_mode() -> str:
    return "preload" if "torch_memory_saver" in os.environ.get("LD_PRELOAD", "") else "torch"


class MemorySaver:
    """Pause/resume of the trainer's GPU memory (one tag); a logged no-op without CUDA or when disabled."""

    def __init__(self, enabled: bool, tag: str = "trainer", cpu_backup: bool = True) -> None:
        self.tag = tag
        self.cpu_backup = cpu_backup
        self.paused = False
        self._tms: Optional[Any] = None
        if not enabled:
            logger.info("memory saver off (trainer.memory_saver: false): pause/resume do nothing")
            return
        if not torch.cuda.is_available():
            logger.info("memory saver: no CUDA device, pause/resume are no-ops (CPU memory is shared anyway)")
            return
        try:
            from torch_memory_saver import torch_memory_saver
        except ImportError as err:
            raise MemorySaverUnavailable(
                "trainer.memory_saver is on but torch_memory_saver is not installed "
                f"(pip install 'rayrl[gpu]' or torch_memory_saver): {err}"
            ) from None
        torch_memory_saver.hook_mode = _hook_mode()  # must be set before the library's first use
        self._tms = torch_memory_saver
        logger.info("memory saver on (tag %r, hook mode %s, cpu backup %s)", tag, _hook_mode(), cpu_backup)

    @property
    def active(self) -> bool:
        """True when pause/resume really move GPU memory."""
        return self._tms is not None

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Allocations made inside (model, optimizer state, gradient buffers) become pauseable."""
        if self._tms is None:
            yield
            return
        with self._tms.region(tag=self.tag, enable_cpu_backup=self.cpu_backup):
            yield

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Inside a region, allocate ordinary (never paused) memory, e.g. communication buffers."""
        if self._tms is None:
            yield
            return
        with self._tms.disable():
            yield

    def pause(self) -> bool:
        """Release the region's GPU memory (contents to host first with cpu_backup). False when no-op."""
        if self._tms is None or self.paused:
            return False
        torch.cuda.synchronize()  # no kernel may still use the memory
        self._tms.pause(self.tag)
        self.paused = True
        return True

    def resume(self) -> bool:
        """Map the memory back at the same addresses (and restore contents with cpu_backup)."""
        if self._tms is None or not self.paused:
            return False
        self._tms.resume(self.tag)
        torch.cuda.synchronize()
        self.paused = False
        return True


def gpu_memory_used_bytes(device: Optional[int] = None) -> int:
    """Memory in use on the device as the driver sees it (what a paused region gives back shows here;
    ``torch.cuda.memory_allocated`` does not change on pause)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)
