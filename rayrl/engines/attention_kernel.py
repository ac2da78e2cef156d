"""The decode step's attention kernel (decode_attention.cpp), built on this machine at engine load.

Why: at 8 running rows about a fifth of a decode step of a small model is attention, one SDPA call per
layer whose CPU kernel spends most of its time setting up MKL's small-matrix GEMMs for two tiny
matrices per (row, KV head). Our kernel does each (row, KV head) as one task that reads the row's keys and
values once for all of the GQA group's queries (docs/results/cpu_engine_goals.md, 2026-11-27 e26, has
the measurements). torch ships no such kernel and no compiled extension can ship in a pure-Python
package, so it is compiled with ``torch.utils.cpp_extension.load`` (gcc, ninja) the first time a process
asks for it, into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), where the next process finds the build and only loads it.

The op's schema is defined here, at import, whether or not the build succeeds, so the TorchScript step
(lean_decode._decoder_layers) compiles either way and chooses per call with a flag: the kernel where
:func:`decode_attention_available` says it runs, SDPA otherwise (no compiler or ninja, a CPU without
AVX2/FMA, not x86-64, a failed build or self-check; logged once with the reason).
``RAYRL_DECODE_ATTENTION=sdpa`` turns the kernel off.
"""

from __future__ import annotations

import functools
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

logger = logging.getLogger("rayrl.engines.attention_kernel")

SOURCE = Path(__file__).with_name("decode_attention.cpp")
CPU_FLAGS = ("avx2", "fma", "f16c")  # what the kernel's -m flags assume
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # -fopenmp: at::parallel_for on torch's libgomp
ENV = "RAYRL_DECODE_ATTENTION"

_LIB = torch.library.Library("rayrl", "FRAGMENT")  # kept alive: dropping it would drop the schema
_LIB.define("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor")

build_seconds = 0.0  # the last call's build or load of the compiled kernel


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def unavailable_reason() -> Optional[str]:
    """Why the kernel cannot be built here (None: it can be tried)."""
    if os.environ.get(ENV, "").lower() == "sdpa":
        return f"{ENV}=sdpa"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not x86-64 ({platform.machine()})"
    missing = [f for f in CPU_FLAGS if f not in _cpu_flags()]
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


def _self_check() -> float:
    """Max |kernel - SDPA| on a small random GQA case with a padding mask (raises if the op fails)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 3, 40, generator=g)
    k, v = torch.randn(3, 2, 37, 40, generator=g), torch.randn(3, 2, 37, 40, generator=g)
    mask = torch.zeros(3, 1, 1, 37)
    mask[1, ..., :5] = float("-inf")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    return float((torch.ops.rayrl.decode_attention(q, k, v, mask, 0.3) - want).abs().max())


@functools.lru_cache(maxsize=1)
def decode_attention_available() -> bool:
    """Whether ``torch.ops.rayrl.decode_attention`` runs in this process: builds the kernel (first time on
    a machine: seconds) or loads the cached build, then checks it against SDPA. Once per process."""
    global build_seconds
    reason = unavailable_reason()
    if reason is None:
        started = time.perf_counter()
        try:
            from torch.utils.cpp_extension import load

            load("rayrl_decode_attention", [str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                 is_python_module=False, verbose=False)
            gap = _self_check()
            reason = None if gap < 1e-4 else f"its self-check is off SDPA by {gap:.1e}"
        except Exception as err:  # no compiler that works, a build error, a kernel that raises
            reason = f"{type(err).__name__}: {str(err)[-500:]}"
        build_seconds = time.perf_counter() - started
    if reason is not None:
        logger.warning("decode attention runs through SDPA, not rayrl's kernel: %s", reason)
        return False
    logger.info("decode attention: rayrl's kernel (built or loaded in %.2f s)", build_seconds)
    return True
