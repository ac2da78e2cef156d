"""How the CPU engine's decode path holds its matmul weights (``engine.weight_format``).

- ``float32``: the weights as loaded, in the engine's dtype (float32 on a CPU without native bf16), used
  by ``F.linear``. Nothing is copied: the fused projections are the model's own parameters (lean_decode.py
  makes q/k/v and gate/up views of one buffer each), so a weight update lands in them directly.
- ``fp16-packed``: a half-precision copy packed for FBGEMM's fp16-weight GEMM
  (``torch.ops.quantized.linear_dynamic_fp16``: float32 activations, float32 accumulation, weights read
  as fp16). Decode at batch 1-32 is bound by the bytes of weights it reads per step, so halving them
  is what speeds it up; bf16/fp16 ``F.linear`` and torch's int8/int4 weight kernels are slower than
  float32 on AVX2 (their vector kernels want bf16 activations). FBGEMM's dynamic int8 linear is faster
  still but moves log-probs, as int8 weights alone do whatever the kernel, past
  ``engine.max_logprob_gap`` (docs/results/design_figures.md; bench/weight_format_candidates.py). The
  copy is made at load and again after every weight update (the packing is FBGEMM's, single-threaded per
  matrix, so matrices are packed in parallel). Log-probs move by about 1e-3 against float32
  (tests/engines/cpu/test_lean_decode.py states the tolerance on the real SmolLM2);
  ``engine.max_logprob_gap`` is the guard that falls back to float32.

Only the CPU engine reads this; SGLang on GPU has its own ``--dtype`` and quantisation flags.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

WEIGHT_FORMATS = ("float32", "fp16-packed")


@functools.lru_cache(maxsize=1)
def fp16_packing_available() -> bool:
    """Whether this torch build has FBGEMM's fp16-weight linear (x86 CPU builds do)."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(8, 8), None)
        out = torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 8), packed)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(out, torch.full((1, 8), 8.0)))


class DenseLinear:
    """``F.linear`` over a weight the model owns (no copy)."""

    fmt = "float32"

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        """Bytes this format keeps beyond the model's own weights (none)."""
        return 0


class Fp16PackedLinear:
    """FBGEMM's fp16-weight linear over a packed half-precision copy of ``weight`` (and its bias)."""

    fmt = "fp16-packed"

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        w = weight.detach().float().contiguous()
        b = bias.detach().float().contiguous() if bias is not None else None
        self.packed = torch.ops.quantized.linear_prepack_fp16(w, b)
        self.out_features, self.in_features = w.shape
        # the overload itself: calling the packet resolves it again on every call (microseconds a matmul)
        self._op = torch.ops.quantized.linear_dynamic_fp16.default

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.packed)

    @property
    def nbytes(self) -> int:
        return 2 * self.out_features * self.in_features


class Fp16PackedChunks:
    """A tall fp16-packed matrix (the vocabulary head: 49,152 x 576 for SmolLM2) as blocks of output
    rows (``parts``, lean_decode.HEAD_CHUNK rows each), each packed on its own; the outputs are
    concatenated.

    Why: FBGEMM's fp16 kernel holds at most 6 activation rows in AVX2 registers, so at 7-32 rows it
    streams each block of the packed weight once per group of rows (twice at 8 rows, six times at 32).
    A whole head's block (512 x vocab halves, 48 MiB) is far beyond the last-level cache, so every
    pass comes from memory; a chunk's block (8 MiB) can stay in the cache between the passes. At 1-6
    rows there is one pass either way."""

    fmt = "fp16-packed"

    def __init__(self, parts: list[Fp16PackedLinear]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], -1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


Linear = DenseLinear | Fp16PackedLinear | Fp16PackedChunks


def make_linear(fmt: str, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Linear:
    """``weight`` (and ``bias``) in format ``fmt``; the dense format keeps references, the packed one a copy."""
    if fmt == "float32":
        return DenseLinear(weight, bias)
    if fmt == "fp16-packed":
        return Fp16PackedLinear(weight, bias)
    raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")


def check_weight_format(fmt: str, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ValueError when ``fmt`` cannot run here (the engine refuses to start, naming the flag)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
    if fmt == "fp16-packed":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError("weight_format fp16-packed needs a float32 engine on CPU "
                             f"(this one: {dtype} on {device.type})")
        if not fp16_packing_available():
            raise ValueError("weight_format fp16-packed needs FBGEMM's fp16 linear, which this torch build lacks")
