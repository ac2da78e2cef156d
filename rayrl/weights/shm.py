"""Weight buffers in shared memory that never outlive their owner.

On CPU the handle transport (rayrl/weights/handles.py) hands an engine each bucket as the name of a
shared-memory file it fills, so no tensor bytes cross HTTP. torch's own ``file_system`` sharing leaves
``/dev/shm/torch_<pid>_*`` files that only its manager process removes, and a process killed with SIGKILL
(with its manager) leaves them for good: 512 MiB per bucket buffer. So rayrl makes its own files:

- named ``rayrl-wbuf-<pid>-<start>-<random>``: the owner's process id and start time (clock ticks after
  boot, ``/proc/<pid>/stat``), so a pid the kernel has since given to another process does not keep a
  dead owner's file alive;
- removed by their owner on :meth:`SharedBuffer.close`, when the buffer is garbage collected and at
  interpreter exit;
- and, for owners that could not (SIGKILL, a lost container), removed by the sweep that trainer ranks and
  engines run when they start (rayrl/weights/owners.py, which names the owners and imports no torch). The
  disk transport's per-rank directories carry the same owner tag (``owner_tag``) and are swept the same way.

An engine opens a buffer by name (:func:`open_buffer`, the one function the weight-payload unpickler
admits besides torch's own): only a name of this form, under the shared-memory root, read through a
private mapping.
"""

from __future__ import annotations

import logging
import os
import uuid
import weakref
from pathlib import Path
from typing import Optional, Sequence

import torch

from rayrl.weights.owners import NAME, PREFIX, owner_tag, shared_memory_root

logger = logging.getLogger(__name__)

ALIGN = 64  # bytes: every packed tensor starts on a boundary any dtype's view accepts


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SharedBuffer:
    """``nbytes`` of named shared memory this process owns; tensors are views of it."""

    def __init__(self, nbytes: int, root: Optional[Path] = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        self.root = Path(root) if root is not None else shared_memory_root()
        self.name = f"{PREFIX}{owner_tag()}-{uuid.uuid4().hex[:12]}"
        self.path = self.root / self.name
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, str(self.path))  # GC and interpreter exit
        self.bytes: Optional[torch.Tensor] = torch.from_file(str(self.path), shared=True, size=nbytes,
                                                             dtype=torch.uint8)
        _LIVE[self.bytes.untyped_storage().data_ptr()] = self

    def typed(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of ``dtype`` (a 1-D view, e.g. a flattened bucket's output)."""
        assert self.bytes is not None, "the buffer is closed"
        return self.bytes[: numel * torch.empty((), dtype=dtype).element_size()].view(dtype)

    def pack(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Copy each tensor into the buffer (any dtypes, aligned) and return ``(name, view)`` pairs."""
        assert self.bytes is not None, "the buffer is closed"
        out, offset = [], 0
        for name, tensor in named:
            size = tensor.numel() * tensor.element_size()
            if offset + size > self.nbytes:
                raise ValueError(f"{name}: {offset + size} bytes do not fit a buffer of {self.nbytes}")
            view = self.bytes[offset: offset + size].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            out.append((name, view))
            offset += -(-size // ALIGN) * ALIGN
        return out

    @staticmethod
    def packed_size(tensors: Sequence[torch.Tensor]) -> int:
        """Bytes :meth:`pack` needs for ``tensors``."""
        return sum(-(-(t.numel() * t.element_size()) // ALIGN) * ALIGN for t in tensors)

    def close(self) -> None:
        """Remove the file; the engines that opened it have copied what they needed."""
        if self.bytes is not None:
            _LIVE.pop(self.bytes.untyped_storage().data_ptr(), None)
            self.bytes = None
        self._finalizer()


_LIVE: dict[int, SharedBuffer] = {}  # storage data pointer -> the open buffer it belongs to


def buffer_ref(tensor: torch.Tensor) -> Optional[tuple[str, int, tuple[int, ...], torch.dtype]]:
    """``(name, byte offset, shape, dtype)`` of a contiguous CPU tensor that lies in an open SharedBuffer
    (what an engine needs to open it), or None for any other tensor."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    buffer = _LIVE.get(tensor.untyped_storage().data_ptr())
    if buffer is None:
        return None
    return buffer.name, tensor.storage_offset() * tensor.element_size(), tuple(tensor.shape), tensor.dtype


def open_buffer(name: str, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The engine's side of :func:`buffer_ref`: a read-only-in-effect (private) mapping of that part of
    the owner's buffer. Only ``rayrl-wbuf-*`` names under the shared-memory root open."""
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"{name!r} is not a rayrl weight buffer name")
    if not isinstance(dtype, torch.dtype) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError("a weight buffer reference needs a torch dtype and a shape of non-negative ints")
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"bad offset {offset!r}")
    path = shared_memory_root() / name
    numel = 1
    for d in shape:
        numel *= d
    end = offset + numel * torch.empty((), dtype=dtype).element_size()
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ValueError(f"weight buffer {name} is gone (its owner closed it or died)") from None
    if end > size:
        raise ValueError(f"weight buffer {name}: bytes [{offset}, {end}) are past its end ({size})")
    if end == offset:
        return torch.empty(tuple(shape), dtype=dtype)
    raw = torch.from_file(str(path), shared=False, size=end, dtype=torch.uint8)
    return raw[offset:end].view(dtype).view(tuple(shape))
