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
- and, for owners that could not (SIGKILL, a lost container), removed by :func:`sweep_dead_buffers`, which
  trainer ranks and engines run when they start. The disk transport's per-rank directories carry the same
  owner tag (:func:`owner_tag`) and are swept the same way.

An engine opens a buffer by name (:func:`open_buffer`, the one function the weight-payload unpickler
admits besides torch's own): only a name of this form, under the shared-memory root, read through a
private mapping.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)

PREFIX = "rayrl-wbuf-"
WEIGHT_BUFFERS = "rayrl-shm"  # what an engine that opens these says in /get_server_info ``weight_buffers``
_NAME = re.compile(r"^rayrl-wbuf-(\d+)-(\d+)-[0-9a-f]{12}$")
_OWNED_DIR = re.compile(r"^rank\d+-(\d+)-(\d+)$")  # the disk transport's rank<r>-<pid>-<start> directories
ALIGN = 64  # bytes: every packed tensor starts on a boundary any dtype's view accepts


def shared_memory_root() -> Path:
    """/dev/shm where it is writable (memory), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks after boot (None: no such process, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'
    return int(stat[stat.rindex(")") + 2:].split()[19])


def owner_tag(pid: Optional[int] = None) -> str:
    """``<pid>-<start>`` of a process (default: this one), the owner part of a buffer's name."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{_start_time(pid) or 0}"


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process that made a buffer still runs (the same pid *and* start time)."""
    now = _start_time(pid)
    if now is not None:
        return start == 0 or now == start
    if Path("/proc/self/stat").exists():  # /proc works and has no such pid: gone
        return False
    try:  # no /proc (not Linux): the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    if not isinstance(name, str) or not _NAME.match(name):
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


def sweep_dead_buffers(root: Optional[Path] = None) -> list[str]:
    """Remove the weight buffers (and disk-transport directories) whose owner process is gone; returns
    their names. Run at trainer and engine start: files of a process killed with SIGKILL go here."""
    root = Path(root) if root is not None else shared_memory_root()
    removed: list[str] = []
    freed = 0
    for path in root.glob(f"{PREFIX}*"):
        m = _NAME.match(path.name)
        if m and not owner_alive(int(m.group(1)), int(m.group(2))):
            try:
                freed += path.stat().st_size
                path.unlink()
                removed.append(path.name)
            except FileNotFoundError:  # another sweeper got there first
                pass
    for run_dir in root.glob("rayrl-*-weights"):
        for path in run_dir.iterdir() if run_dir.is_dir() else []:
            m = _OWNED_DIR.match(path.name)
            if m and not owner_alive(int(m.group(1)), int(m.group(2))):
                freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path, ignore_errors=True)
                removed.append(f"{run_dir.name}/{path.name}")
    if removed:
        shown = ", ".join(removed[:5]) + (" ..." if len(removed) > 5 else "")
        logger.warning("removed %d weight buffer(s) (%.0f MiB) left in %s by processes that are gone: %s",
                       len(removed), freed / 2**20, root, shown)
    return removed


def sweep_quietly() -> list[str]:
    """:func:`sweep_dead_buffers` for actor start-up: a sweep that fails must not stop a start."""
    try:
        return sweep_dead_buffers()
    except OSError as err:
        logger.warning("sweeping dead weight buffers failed: %s", err)
        return []
