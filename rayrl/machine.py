"""What this machine computes with: its cores, whether CUDA is present, whether the CPU computes bfloat16
natively, its CPU flags, and the ``auto`` dtype rule that follows from them.

One home for machine detection: the resolve step (rayrl/resolve.py) asks it for ``engine.dtype``,
``trainer.compute_dtype`` and the CPU thread counts; the CPU engine, the torch trainer, the gateway and the
decode kernels ask it where they run. It reads the machine and nothing of rayrl.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    """What resolution depends on: the cores this process may use, whether CUDA is present, and whether
    the CPU computes bfloat16 natively (AVX512-BF16 or AMX; elsewhere torch emulates it, and a batched
    matmul in bf16 runs at a fraction of float32's speed: docs/results/design_figures.md has the figures;
    :func:`cpu_has_native_bf16`)."""

    cores: int
    cuda: bool
    native_bf16: bool = False

    @classmethod
    def detect(cls) -> Machine:
        """This process's machine: its CPU affinity (which containers and taskset narrow) and
        ``torch.cuda.is_available()`` (False without torch)."""
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        try:
            import torch
        except ImportError:
            return cls(cores=cores, cuda=False)
        return cls(cores=cores, cuda=bool(torch.cuda.is_available()), native_bf16=cpu_has_native_bf16())


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively. On x86: AVX512-BF16 or AMX, asked of torch's own CPU
    checks (or, where this torch lacks them, the kernel's CPU flags). oneDNN's check alone
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) also says yes on any AVX512 CPU, where bf16 is
    emulated, several times slower than float32 (docs/results/design_figures.md), so ``auto`` must not
    pick it there. Elsewhere (Arm) oneDNN's check stands."""
    import platform

    import torch

    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        cpu = getattr(torch, "cpu", None)
        checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        if all(callable(check) for check in checks):
            return any(bool(check()) for check in checks)
        return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the Linux kernel lists them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compute_dtype(requested: str, cuda: bool, native_bf16: bool) -> str:
    """``auto`` made concrete for a device: bfloat16 where it is computed natively, float32 elsewhere.
    The rule for ``engine.dtype`` and ``trainer.compute_dtype`` (one home)."""
    if requested != "auto":
        return requested
    return "bfloat16" if cuda or native_bf16 else "float32"
