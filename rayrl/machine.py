"""What this machine computes with: its cores, whether CUDA is present, whether the CPU computes bfloat16
natively, its CPU flags, and the ``auto`` dtype rule that follows from them.

One home for machine detection: the resolve step (rayrl/resolve.py) asks it for ``engine.dtype``,
``trainer.compute_dtype`` and the CPU thread counts; the CPU engine, the torch trainer, the gateway and the
decode kernels ask it where they run. It reads the machine, and of rayrl only where its cache lives.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Optional


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
        """This process's machine: its CPU affinity (which containers and taskset narrow) and what torch
        says of CUDA and bfloat16 (no CUDA without torch), remembered per boot (:func:`torch_facts`)."""
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        cuda, native_bf16 = torch_facts()
        return cls(cores=cores, cuda=cuda, native_bf16=native_bf16)


FACTS_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def _facts_key() -> Optional[str]:
    """What torch's answers depend on, without importing it: this boot (devices and drivers change only
    across one), the torch installation (path and version: a CPU and a CUDA build differ), the variables
    that hide devices and the device nodes present. None where there is no boot id (not Linux): no cache."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        spec = importlib.util.find_spec("torch")
    except (OSError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    devices = sorted(name for name in os.listdir("/dev") if name.startswith(("nvidia", "kfd", "dri")))
    parts = [boot, spec.origin, version, *(f"{k}={os.environ.get(k)}" for k in FACTS_ENV), *devices]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def torch_facts() -> tuple[bool, bool]:
    """``(torch.cuda.is_available(), cpu_has_native_bf16())``; (False, False) without torch.

    Why remembered: the driver asks this before it starts the parts (rayrl/resolve.py), and importing torch
    for it took 1.5-2.5 s of every start on a 2-core machine, where the driver needs torch for nothing
    else. The answers are kept under rayrl's cache directory (``$RAYRL_CACHE/machine/``), keyed by what they
    depend on (:func:`_facts_key`), so the first start on a boot asks torch and the others read the file."""
    from rayrl.models import cache_dir

    key = _facts_key()
    path = cache_dir() / "machine" / f"torch-{key}.json"
    if key is not None:
        try:
            facts = json.loads(path.read_text())
            return bool(facts["cuda"]), bool(facts["native_bf16"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    try:
        import torch
    except ImportError:
        return False, False
    cuda, native_bf16 = bool(torch.cuda.is_available()), cpu_has_native_bf16()
    if key is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"cuda": cuda, "native_bf16": native_bf16}))
            os.replace(tmp, path)
        except OSError:  # a read-only cache: asked again next time
            pass
    return cuda, native_bf16


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
