"""The decode step's own CPU kernels (decode_kernels.cpp), built on this machine at engine load.

Why: a decode step of a small model at 1-8 rows is, besides FBGEMM's matmuls, attention over the cache
and ~20 small ops per layer of a few microseconds each. torch's SDPA CPU kernel spends most of a decode
call setting up MKL's small-matrix GEMMs for two tiny matrices per (row, KV head); our
``decode_attention`` does each (row, KV head) as one task that reads the row's keys and values once for
all of the GQA group's queries. ``rope_cache`` (RoPE on the query and key heads plus the cache column
write), ``silu_mul`` and ``add_rms_norm`` (residual add and the next norm) each replace 2-4 torch ops
with one pass. docs/results/cpu_engine_goals.md has the measurements.

torch ships no such kernels and a pure-Python package cannot ship a compiled extension, so they are
compiled with ``torch.utils.cpp_extension.load`` (a C++ compiler and ninja) the first time a process asks
for them (15-19 s), into a folder keyed by what the build depends on (:func:`build_directory`: under
``TORCH_EXTENSIONS_DIR`` when set, else rayrl's cache directory), where the next process finds the build and
only loads it (about 0.2 s), whichever checkout it runs from.

The ops' schemas are defined here, at import, whether or not the build succeeds, so the TorchScript step
(lean_decode._decoder_layers) compiles either way and chooses per call with a flag: our kernels where
:func:`decode_kernels_available` says they run, torch's ops otherwise (no compiler or ninja, a CPU
without AVX2/FMA/F16C, not x86-64, a failed build or self-check; logged once with the reason).
``RAYRL_DECODE_KERNELS=off`` turns them off.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from rayrl.machine import cpu_flags

logger = logging.getLogger("rayrl.engines.cpu.decode_kernels")

SOURCE = Path(__file__).with_name("decode_kernels.cpp")
CPU_FLAGS = ("avx2", "fma", "f16c")  # what the kernels' -m flags assume
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # -fopenmp: at::parallel_for on torch's libgomp
LDFLAGS = ["-fopenmp"]
ENV = "RAYRL_DECODE_KERNELS"
NAME = "rayrl_decode_kernels"
SCHEMAS = (
    "decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor",
    "rope_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) new_col, int heads) -> ()",
    "silu_mul(Tensor gate_up) -> Tensor",
    "add_rms_norm(Tensor(a!) x, Tensor y, Tensor weight, float eps) -> Tensor",
)

_LIB = torch.library.Library("rayrl", "FRAGMENT")  # kept alive: dropping it would drop the schemas
for _schema in SCHEMAS:
    _LIB.define(_schema)

build_seconds = 0.0  # the last call's build or load of the compiled kernels


def unavailable_reason() -> Optional[str]:
    """Why the kernels cannot be built here (None: they can be tried)."""
    if os.environ.get(ENV, "").lower() in ("off", "0", "no", "false"):
        return f"{ENV}={os.environ[ENV]}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not x86-64 ({platform.machine()})"
    missing = [f for f in CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++)"
    if shutil.which("ninja") is None:
        local = Path(sys.executable).parent / "ninja"  # the venv's ninja, when the venv is not activated
        if not local.exists():
            return "no ninja"
        os.environ["PATH"] = f"{local.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return None


def build_key() -> str:
    """What a build depends on, hashed: the source, the flags, torch, Python, the machine's architecture
    and the compiler. Two checkouts of the same rayrl share one build; a changed source, flag, torch or
    compiler gets a folder of its own instead of rebuilding over (and racing with) another's."""
    cxx = os.environ.get("CXX", "c++")
    parts = [SOURCE.read_bytes(), repr((CFLAGS, LDFLAGS)).encode(), torch.__version__.encode(), sys.version.encode(),
             platform.machine().encode(), cxx.encode(), str(shutil.which(cxx)).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build_directory() -> Path:
    """Where the kernels are built and cached: one folder per :func:`build_key` under
    ``TORCH_EXTENSIONS_DIR`` when set, else under rayrl's cache directory (``RAYRL_CACHE``, default
    ~/.cache/rayrl, where the converted models are too). The source is copied in, so the build never
    names a checkout's path: torch's build file stays the same from one checkout to the next, and ninja
    finds nothing to do."""
    from rayrl.models import cache_dir

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cache_dir() / "kernels")
    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}".replace("+", "_")
    path = root / f"{NAME}-{tag}-{build_key()}"
    path.mkdir(parents=True, exist_ok=True)
    source = path / SOURCE.name
    if not source.exists():  # same key, same bytes: written once, its mtime older than every build after
        tmp = path / f".{SOURCE.name}.{os.getpid()}"
        shutil.copyfile(SOURCE, tmp)
        os.replace(tmp, source)
    return path


def _build_or_load(path: Path) -> None:
    """torch's loader marks a build in progress with a plain ``lock`` file, and any other process waits
    while it exists, for ever: a build killed midway (a timed-out test, a killed actor) hangs every later
    engine on the machine. So processes take turns here under an OS lock, which the kernel frees when its
    holder dies; whoever holds it is the only builder, so a ``lock`` file found then is a dead build's."""
    from torch.utils.cpp_extension import load

    with open(path / "rayrl-build.flock", "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        dead = path / "lock"
        if dead.exists():
            dead.unlink()
            logger.warning("removed the build lock of a build that did not finish (%s)", dead)
        # copies of the flags: torch appends to the lists it is given (and the key reads them)
        load(NAME, [str(path / SOURCE.name)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
             build_directory=str(path), is_python_module=False, verbose=False)


def _self_check() -> float:
    """The largest |kernel - torch| over the four ops on small random inputs (raises if an op fails)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 3, 40, generator=g)
    k, v = torch.randn(3, 2, 37, 40, generator=g), torch.randn(3, 2, 37, 40, generator=g)
    mask = torch.zeros(3, 1, 1, 37)
    mask[1, ..., :5] = float("-inf")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    gaps = [(torch.ops.rayrl.decode_attention(q, k, v, mask, 0.3) - want).abs().max()]
    gate_up = torch.randn(2, 2 * 36, generator=g) * 4
    gaps.append((torch.ops.rayrl.silu_mul(gate_up) - F.silu(gate_up[:, :36]) * gate_up[:, 36:]).abs().max())
    x, y, w = torch.randn(2, 44, generator=g), torch.randn(2, 44, generator=g), torch.randn(44, generator=g)
    want = torch.rms_norm(x + y, [44], w, 1e-5)
    gaps.append((torch.ops.rayrl.add_rms_norm(x, y, w, 1e-5) - want).abs().max())
    qkv, cos, sin = torch.randn(2, 4, 20, generator=g), torch.randn(2, 20, generator=g), torch.randn(2, 20, generator=g)
    rotated = qkv * cos.view(2, 1, 20) + qkv.roll(10, -1) * sin.view(2, 1, 20)
    col = torch.empty(2, 2, 1, 20)
    torch.ops.rayrl.rope_cache(qkv, cos, sin, col, 2)
    gaps += [(qkv[:, :2] - rotated[:, :2]).abs().max(), (col[0, :, 0] - rotated[:, 2]).abs().max(),
             (col[1, :, 0] - qkv[:, 3]).abs().max()]
    return float(max(gaps))


@functools.lru_cache(maxsize=1)
def decode_kernels_available() -> bool:
    """Whether the ``torch.ops.rayrl`` kernels run in this process: builds them (first time on a machine:
    seconds) or loads the cached build, then checks them against torch's ops. Once per process."""
    global build_seconds
    reason = unavailable_reason()
    if reason is None:
        started = time.perf_counter()
        try:
            _build_or_load(build_directory())
            gap = _self_check()
            reason = None if gap < 1e-4 else f"their self-check is off torch's ops by {gap:.1e}"
        except Exception as err:  # no compiler that works, a build error, a kernel that raises
            reason = f"{type(err).__name__}: {str(err)[-500:]}"
        build_seconds = time.perf_counter() - started
    if reason is not None:
        logger.warning("the decode step runs on torch's ops (SDPA), not rayrl's kernels: %s", reason)
        return False
    logger.info("the decode step runs on rayrl's kernels (built or loaded in %.2f s)", build_seconds)
    return True
