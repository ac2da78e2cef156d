"""The trainer's GPU memory in pauseable regions, with its contents kept in pinned host buffers of our own.

Colocated on a GPU, the trainer gives its memory to the engines during rollout. Everything the trainer
must keep (parameters, gradient buffers, optimizer state: the backends allocate all of it inside
:meth:`MemorySaver.region`) lives in torch_memory_saver's region memory pool. :meth:`MemorySaver.pause`
copies that pool's segments into one pinned host buffer, then lets torch_memory_saver release the
physical GPU memory (the virtual addresses stay reserved); :meth:`MemorySaver.resume` maps memory back
at the same addresses and copies the contents back, bit for bit. Tensors, the optimizer and any
captured CUDA graph keep working without being rebuilt. Pause also returns the caching allocator's
free blocks (the last step's activations) to the driver, so the engines get those too.

Why our own host buffers instead of the library's CPU backup: torch_memory_saver allocates a pinned
host copy (``cudaMallocHost``) at every pause and frees it at every resume (before 0.0.10 it cannot
keep it; SGLang pins 0.0.9), then copies with synchronous ``cudaMemcpy`` per allocation. Its own
tracker reports pause at 2.41 GiB/s and resume at 5.32 GiB/s against 24.4 / 23.5 GiB/s for a plain
pinned ``copy_`` of the same bytes on the same GPU (fzyzcjy/torch_memory_saver#111), which makes
sleep + wake most of a colocated step. Here the host buffer is allocated and page-locked once
(``cudaHostRegister`` of one buffer of exactly the region's size; torch's pinned allocator would round
it up to a power of two) and reused by every cycle, and the copies are asynchronous ``copy_`` calls of
whole segments, i.e. the plain pinned copy itself. The price: the host keeps one pinned copy of the
trainer's GPU state for the life of the process. tests/gpu/test_gpu_offload_bandwidth.py measures
both against a plain pinned copy (docs/gpu.md, docs/gpu-validation.md).

On CPU, or with the saver turned off, every method is a no-op and a single log line says why, so the
same trainer code runs everywhere. :class:`HostBackup` (the copy logic) is plain torch and is tested on
CPU (tests/trainers/test_memory_saver_cpu.py).

Hook mode: torch_memory_saver intercepts CUDA allocations either by ``LD_PRELOAD`` of its hook library
(which must be set when the process starts) or through torch's pluggable allocator ("torch" mode, no
preload, but no pauseable CUDA graphs). "torch" mode ends the process with ``exit(1)`` whenever region
memory is freed outside a region, which interpreter teardown does with the region's pool: on an H100
every process that had used a region exited 1 after its work was done, and preload mode exited 0
(tests/gpu/test_gpu_memory_saver.py; the run: docs/results/design_figures.md). So trainer ranks on GPU
are started with the preload (rayrl/trainers/saver_preload.py ``preload_env``, read by actors/trainer.py when it
creates them), as
slime starts its train actors;
"torch" stays the fallback for a process started without it.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

Segment = tuple[int, int]  # (device address, bytes)
DEFAULT_POOL = (0, 0)  # the caching allocator's own pool; torch_memory_saver regions use a MemPool of their own
ViewFn = Callable[[int, int], torch.Tensor]  # (address, bytes) -> a uint8 tensor over that memory


class MemorySaverUnavailable(RuntimeError):
    """The saver was asked for on a GPU, but torch_memory_saver cannot be used there."""


def _hook_mode() -> str:
    return "preload" if "torch_memory_saver" in os.environ.get("LD_PRELOAD", "") else "torch"


class _CudaBytes:
    """A raw device range as a CUDA array, so torch can view it (``torch.as_tensor``) without owning it."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3, "strides": None,
        }  # fmt: skip


def cuda_bytes(address: int, size: int) -> torch.Tensor:
    """A uint8 tensor over ``size`` bytes of device memory at ``address`` (not owned)."""
    return torch.as_tensor(_CudaBytes(address, size), device="cuda")


class HostBackup:
    """One host buffer holding copies of device segments; reused by every save while the segments fit.

    ``save(segments)`` copies each segment (through ``view``) into the buffer back to back,
    ``restore()`` copies them back to the same addresses. ``pin`` page-locks the buffer
    (``cudaHostRegister``) so both directions run as DMA at the link's speed; ``synchronize`` waits for
    the asynchronous copies.
    """

    def __init__(self, view: ViewFn, *, pin: bool, synchronize: Callable[[], None] = lambda: None) -> None:
        self.view = view
        self.pin = pin
        self.synchronize = synchronize
        self.buffer: Optional[torch.Tensor] = None
        self.segments: list[Segment] = []
        self.allocations = 0  # how many host buffers were made (1 in steady state)
        self._unpin: Optional[weakref.finalize] = None

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.segments)

    def _ensure_capacity(self, nbytes: int) -> torch.Tensor:
        if self.buffer is not None and self.buffer.numel() >= nbytes:
            return self.buffer
        self.release()
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin and nbytes:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
            # unpinned before the buffer is freed even when this object is just dropped (a trainer garbage
            # collected): a freed range the driver still has registered makes the next registration that
            # lands on those addresses fail with "already mapped"
            self._unpin = weakref.finalize(self, _unregister_host, buffer)
        self.buffer = buffer
        self.allocations += 1
        return buffer

    def save(self, segments: Sequence[Segment]) -> int:
        """Copy ``segments`` to the host; returns the bytes copied."""
        self.segments = list(segments)
        buffer = self._ensure_capacity(self.nbytes)
        offset = 0
        for address, size in self.segments:
            buffer[offset : offset + size].copy_(self.view(address, size), non_blocking=True)
            offset += size
        self.synchronize()
        return offset

    def restore(self) -> int:
        """Copy the saved bytes back to where they came from; returns the bytes copied."""
        if self.buffer is None:
            return 0
        offset = 0
        for address, size in self.segments:
            self.view(address, size).copy_(self.buffer[offset : offset + size], non_blocking=True)
            offset += size
        self.synchronize()
        return offset

    def release(self) -> None:
        """Drop the host buffer (unpinning it)."""
        if self._unpin is not None:
            self._unpin()  # once: a finalizer that ran is dead
            self._unpin = None
        self.buffer = None


def _unregister_host(buffer: torch.Tensor) -> None:
    """Unpin a host buffer :class:`HostBackup` pinned (``cudaHostUnregister``)."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))


class _Intervals:
    """Membership of addresses in sorted, disjoint (address, size) segments."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.starts = [a for a, _ in segments]
        self.ends = [a + n for a, n in segments]

    def holds(self, address: int) -> bool:
        i = bisect.bisect_right(self.starts, address) - 1
        return i >= 0 and address < self.ends[i]


def pool_segments(
    snapshot: Sequence[dict[str, Any]], pools: set[tuple[int, int]], device: int
) -> list[Segment]:
    """The (address, size) of every segment of ``device`` that belongs to one of ``pools``
    (``torch.cuda.memory_snapshot()`` entries), in address order."""
    return sorted(
        (int(s["address"]), int(s["total_size"]))
        for s in snapshot
        if s.get("device", device) == device and tuple(s.get("segment_pool_id", ())) in pools
    )


def pool_of(snapshot: Sequence[dict[str, Any]], address: int) -> Optional[tuple[int, int]]:
    """The memory pool id of the segment holding ``address`` (None when no segment holds it)."""
    for s in snapshot:
        if s["address"] <= address < s["address"] + s["total_size"]:
            return tuple(s["segment_pool_id"])  # type: ignore[return-value]
    return None


class MemorySaver:
    """Pause/resume of the trainer's GPU memory (one tag); a logged no-op without CUDA or when disabled."""

    def __init__(
        self, enabled: bool, tag: str = "trainer", device: Optional[torch.device | str] = None
    ) -> None:
        """``device``: the trainer's device (a saver for a trainer on CPU is a no-op)."""
        self.tag = tag
        self.device_type = "cuda"  # the tensors a pause concerns
        self.paused = False
        self.last_cycle: dict[str, float] = {}  # bytes and seconds of the last pause and resume
        self._tms: Optional[Any] = None
        self._pools: set[tuple[int, int]] = set()
        self._backup: Optional[HostBackup] = None
        if not enabled:
            logger.info("memory saver off (trainer.memory_saver: false): pause/resume do nothing")
            return
        where = torch.device(device) if device is not None else None
        if not torch.cuda.is_available() or (where is not None and where.type != "cuda"):
            logger.info("memory saver: no CUDA device, pause/resume are no-ops (CPU memory is shared anyway)")
            return
        try:
            from torch_memory_saver import torch_memory_saver
        except ImportError as err:
            raise MemorySaverUnavailable(
                "trainer.memory_saver is on but torch_memory_saver is not installed "
                f"(pip install 'rayrl[gpu]' or torch_memory_saver): {err}"
            ) from None
        try:
            torch_memory_saver.hook_mode = _hook_mode()  # only before the library's first use in the process
        except (AssertionError, AttributeError):
            pass  # an earlier saver in this process initialised the library with the same mode
        self._tms = torch_memory_saver
        index = where.index if where is not None else None
        self._device = index if index is not None else torch.cuda.current_device()
        self._backup = HostBackup(cuda_bytes, pin=True, synchronize=torch.cuda.synchronize)
        logger.info("memory saver on (tag %r, hook mode %s, contents kept in a pinned host buffer)",
                    tag, _hook_mode())

    @property
    def active(self) -> bool:
        """True when pause/resume really move GPU memory."""
        return self._tms is not None

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Allocations made inside (model, optimizer state, gradient buffers) become pauseable, and their
        contents are kept over a pause."""
        if self._tms is None:
            yield
            return
        with self._tms.region(tag=self.tag, enable_cpu_backup=False):
            self._note_pool()
            yield

    def _note_pool(self) -> None:
        """Find the memory pool the library allocates this region from: a probe allocated inside it."""
        probe = torch.empty(1, device="cuda")
        pool = pool_of(torch.cuda.memory_snapshot(), probe.data_ptr())
        del probe
        if pool is None or pool == DEFAULT_POOL:
            raise MemorySaverUnavailable(
                "memory saver: an allocation made inside the torch_memory_saver region is "
                f"{'in no segment' if pool is None else 'in the default memory pool'} of "
                "torch.cuda.memory_snapshot(), so the region's memory cannot be told apart and its contents "
                "could not be kept over a pause"
            )
        self._pools.add(pool)

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Inside a region, allocate ordinary (never paused) memory, e.g. communication buffers."""
        if self._tms is None:
            yield
            return
        with self._tms.disable():
            yield

    def region_segments(self) -> list[Segment]:
        """The device segments the region holds now (what a pause copies and releases)."""
        if self._tms is None:
            return []
        return pool_segments(torch.cuda.memory_snapshot(), self._pools, self._device)

    def _region_index(self) -> _Intervals:
        return _Intervals(self.region_segments())

    def _outside(self, index: _Intervals, value: Any) -> bool:
        return (isinstance(value, torch.Tensor) and value.device.type == self.device_type
                and not index.holds(value.data_ptr()))  # fmt: skip

    def bytes_outside(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the device tensors among ``tensors`` whose memory is not in the region (0 when
        inactive): what a pause would leave on the GPU."""
        if not self.active:
            return 0
        index = self._region_index()
        return sum(t.nbytes for t in tensors if self._outside(index, t))

    def adopt_optimizer_state(self, optimizer: Any) -> int:
        """Copy optimizer state tensors that live outside the region into it (``load_state_dict`` makes new
        ones); returns the bytes moved. Works on torch optimizers and Megatron's (chained) wrappers."""
        if not self.active:
            return 0
        index = self._region_index()
        moved = 0
        with self.region():
            for inner in _inner_optimizers(optimizer):
                for state in inner.state.values():
                    for key, value in state.items():
                        if self._outside(index, value):
                            state[key] = value.clone()
                            moved += value.nbytes
        torch.cuda.empty_cache()  # the copies they replace
        return moved

    def pause(self) -> bool:
        """Copy the region to host, release its GPU memory and the allocator's free cache (False: no-op)."""
        if self._tms is None or self.paused:
            return False
        assert self._backup is not None
        started = time.perf_counter()
        torch.cuda.synchronize()  # no kernel may still use the memory
        torch.cuda.empty_cache()  # the default pool's free blocks (activations) go back to the driver
        copied = self._backup.save(self.region_segments())
        copied_at = time.perf_counter()
        self._tms.pause(self.tag)
        self.paused = True
        self.last_cycle = {"bytes": float(copied), "pause_copy_s": copied_at - started,
                           "pause_s": time.perf_counter() - started,
                           "host_buffers_made": float(self._backup.allocations)}  # fmt: skip
        logger.info("memory saver: paused %.2f GiB in %.3f s", copied / 2**30, self.last_cycle["pause_s"])
        return True

    def resume(self) -> bool:
        """Map the memory back at the same addresses and restore its contents."""
        if self._tms is None or not self.paused:
            return False
        assert self._backup is not None
        started = time.perf_counter()
        self._tms.resume(self.tag)
        mapped_at = time.perf_counter()
        self._backup.restore()
        self.paused = False
        done = time.perf_counter()
        self.last_cycle.update(resume_copy_s=done - mapped_at, resume_s=done - started)
        logger.info("memory saver: resumed in %.3f s", self.last_cycle["resume_s"])
        return True


def _init_adam(optimizer: torch.optim.Optimizer) -> None:
    """Adam/AdamW's state as its ``_init_group`` makes it at the first step: same tensors, dtypes, devices."""
    for group in optimizer.param_groups:
        fused, on_device = bool(group.get("fused")), bool(group.get("capturable") or group.get("fused"))
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 and not fused else torch.float32
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            where = p.device if on_device else torch.device("cpu")  # on CPU unless fused/capturable
            state["step"] = torch.zeros((), dtype=scalar, device=where)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _params_with_state(optimizer: Any) -> int:
    return sum(1 for state in optimizer.state.values() if state)


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers holding the state: ``optimizer`` itself, or those a Megatron wrapper (chained
    or not) wraps."""
    wrappers = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    inner = [w if isinstance(w, torch.optim.Optimizer) else getattr(w, "optimizer", None) for w in wrappers]
    return [o for o in inner if o is not None]


def init_optimizer_state(optimizer: Any) -> int:
    """Create an optimizer's per-parameter state now, not at its first step; returns how many parameters
    have state afterwards. Call it inside :meth:`MemorySaver.region`: Adam creates its moments lazily,
    and a first step taken outside the region would put the largest block of trainer memory where a
    pause cannot free it.

    torch Adam/AdamW get exactly the state their first step would make, so the steps that follow are
    bit for bit those of a lazily initialised optimizer (tests/trainers/test_memory_saver_cpu.py). A Megatron
    optimizer (chained or not) runs its own ``init_state_fn``: the zeroed moments Megatron itself makes
    before loading a checkpoint. Parameters that already have state are left alone.
    """
    wrappers = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    total = 0
    for wrapper in wrappers:
        inner = wrapper if isinstance(wrapper, torch.optim.Optimizer) else getattr(wrapper, "optimizer", None)
        if inner is None:
            continue
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            _init_adam(inner)
        elif getattr(wrapper, "init_state_fn", None) is not None:
            wrapper.init_state_fn(inner, getattr(wrapper, "config", None))
        total += _params_with_state(inner)
    if total == 0:
        logger.warning("memory saver: %s has no eager state initialisation; state its first step creates "
                       "will stay on the GPU when the trainer is offloaded", type(optimizer).__name__)
    return total

