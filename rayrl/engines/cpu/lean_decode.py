"""The CPU engine's own decode step for Llama-family models (Llama/SmolLM2, Qwen2, Qwen3).

Why: at batch 1-32 a decode step of a small model is a few hundred microsecond-sized matmuls, and the
transformers forward spends more time in Python and op dispatch (about 5,800 aten calls per step for
SmolLM2-135M: masks, cache bookkeeping, repeated head splits) than llama.cpp spends on the whole token.
This module is the same arithmetic in as few ops as the model allows:

- q/k/v and gate/up are fused into one matmul each. In the ``float32`` weight format the fused matrices
  ARE the model's parameters: :func:`fuse_projections` makes q/k/v (and gate/up) views into one buffer
  per layer, so transformers' prefill, the weight updates (copied in place, weights/wire.py) and this
  path all read the same memory. In ``fp16-packed`` the fused matrices are packed copies (weight_formats.py),
  rebuilt by :meth:`LeanDecoder.repack` after every update, in parallel over matrices.
- RoPE comes from a table computed once by the model's own rotary module (so every RoPE variant it
  implements statically: default, linear, llama3, yarn), indexed by position: one gather per step.
- Keys and values go straight into the running batch's cache buffers (kv_cache.BatchKV) at the step's
  column; attention reads a view of them. Grouped-query heads reach attention as several queries of one
  KV head, so the shared keys are never repeated. No mask is built when no running row has padding.
- Where rayrl's own CPU kernels build (decode_kernels.py: C++/AVX2, compiled once per machine at engine
  load, cached), the step's work between the matmuls runs on them: attention for few query rows
  (each row's keys and values read once for the whole GQA group, instead of SDPA's small-GEMM path),
  RoPE fused with the cache column write, silu * up, and each residual add fused with the next RMS
  norm, which makes the step faster (docs/results/cpu_engine_goals.md has the figures). Elsewhere (no compiler, no
  AVX2/FMA, ``RAYRL_DECODE_KERNELS=off``) the same scripted function runs torch's ops and SDPA, chosen
  per call by a flag; :attr:`LeanDecoder.attention` (the engine's ``decode_attention`` stat) says which.
- The head's output is the ``[rows, vocab]`` float32 logits the sampler takes as is.
- The decoder layers of a step run as one TorchScript call (:func:`_decoder_layers`, both weight
  formats: one copy of the arithmetic): calling FBGEMM's op on a packed weight from Python costs about a
  third of a small matmul in argument handling, and a step has 120 of them plus ~20 small ops per layer.
  TorchScript is used because ``torch.compile`` cannot trace the packed-weight op (a graph break at every
  matmul). The weights are arguments, not constants, so a repacking after a weight update needs no
  recompilation.
- In ``fp16-packed`` the vocabulary head is packed in row blocks (weight_formats.Fp16PackedChunks), so at
  7-32 rows its weight is not streamed from memory once per group of rows FBGEMM's kernel holds.

Prefill runs through the same weights (:meth:`LeanDecoder.prefill`: prompt columns in left-padded
batches, or on top of cached prefixes, as prefill.py builds them), so a request's first token and the
prompt's cached keys come from the format its decode steps use. The transformers model stays the
reference (tests/engines/cpu/test_lean_decode.py holds this path's log-probs to it on the real SmolLM2).
Models this path does not cover (another architecture, a dynamic RoPE, sliding-window attention) run
through transformers as before (:func:`unsupported_reason` says why).
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional

import torch
import torch.nn.functional as F

from rayrl.engines.cpu.decode_kernels import decode_kernels_available
from rayrl.engines.cpu.kv_cache import BatchKV
from rayrl.engines.cpu.weight_formats import Fp16PackedChunks, Linear, make_linear

logger = logging.getLogger("rayrl.engines.cpu.lean_decode")

FAMILIES = ("llama", "qwen2", "qwen3")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
ROPE_CHUNK = 4096  # positions per call of the rotary module while the table is built
HEAD_CHUNK = 8192  # vocabulary rows per packed block of the fp16 head (weight_formats.Fp16PackedChunks)


def unsupported_reason(model: Any, device: torch.device) -> Optional[str]:
    """Why the lean path cannot decode ``model`` here (None: it can)."""
    cfg = model.config
    if device.type != "cpu":
        return f"the lean decode path runs on CPU (device {device.type})"
    if cfg.model_type not in FAMILIES:
        return f"model type {cfg.model_type!r} (the lean path covers {', '.join(FAMILIES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"RoPE type {rope!r} (its frequencies depend on the sequence length)"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    return None


def fuse_projections(model: Any) -> None:
    """Make each layer's q/k/v weights (and biases) views of one ``[q+k+v, hidden]`` buffer, and
    gate/up of one ``[2 * intermediate, hidden]`` buffer. The parameters keep their names, shapes and
    values; only where they live changes, so the fused matmul reads them without a copy."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            _share(attn.q_proj, attn.k_proj, attn.v_proj)
            _share(mlp.gate_proj, mlp.up_proj)


def _share(*linears: torch.nn.Linear) -> None:
    for attr in ("weight", "bias"):
        params = [getattr(lin, attr) for lin in linears]
        if any(p is None for p in params):
            continue
        if _is_fused(params):
            continue
        fused = torch.cat([p.data for p in params])
        start = 0
        for p in params:
            p.data = fused[start : start + p.shape[0]]
            start += p.shape[0]


def _is_fused(params: list[torch.Tensor]) -> bool:
    """Whether ``params`` are already consecutive row blocks of one buffer."""
    first = params[0]
    if not first.is_contiguous():
        return False
    offset = first.data_ptr()
    for p in params:
        if p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or p.data_ptr() != offset:
            return False
        offset += p.numel() * p.element_size()
    return True


def _fused_view(params: list[torch.Tensor]) -> torch.Tensor:
    """The buffer ``params`` (fused by :func:`fuse_projections`) are consecutive blocks of."""
    first = params[0]
    rows = sum(p.shape[0] for p in params)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _matmul(x: torch.Tensor, i: int, packed: List[torch.classes.quantized.LinearPackedParamsBase],
            dense: List[torch.Tensor], biases: List[Optional[torch.Tensor]]) -> torch.Tensor:
    """Matrix ``i`` of the step applied to ``x``: FBGEMM's fp16 op on a packed weight (its bias packed
    with it), or ``F.linear`` on the model's own float32 weight where ``dense`` is given."""
    if len(dense) == 0:
        return torch.ops.quantized.linear_dynamic_fp16(x, packed[i])
    return F.linear(x, dense[i], biases[i])


def _add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, kernel: bool) -> torch.Tensor:
    """``x += y`` in place, then the RMS norm of ``x`` with ``weight``: one pass in rayrl's kernel."""
    if kernel:
        return torch.ops.rayrl.add_rms_norm(x, y, weight, eps)
    x += y
    return torch.rms_norm(x, [x.size(1)], weight, eps)


def _decoder_layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor],
                    new_cols: List[torch.Tensor], keys: List[torch.Tensor], values: List[torch.Tensor],
                    norms: List[torch.Tensor], qk_norms: List[torch.Tensor],
                    packed: List[torch.classes.quantized.LinearPackedParamsBase], dense: List[torch.Tensor],
                    biases: List[Optional[torch.Tensor]], sizes: List[int], eps: float, scale: float,
                    kernel: bool) -> torch.Tensor:
    """Every decoder layer of :meth:`LeanDecoder.step`, in either weight format; run by TorchScript
    (:func:`decoder_layers`): the interpreter calls the ops without Python's per-call argument handling
    (for FBGEMM's packed-weight op about a third of a small matmul's time) and runs the ~20 other ops per
    layer without Python frames. ``x`` ``[n, hidden]`` is updated in place and returned. Per layer ``i``:
    ``norms[2i]``, ``norms[2i + 1]`` (input and post-attention), ``qk_norms[2i]``, ``qk_norms[2i + 1]``
    (Qwen3's q/k norms; empty where the model has none), matrices ``4i .. 4i + 3`` (qkv, o, gate_up,
    down) in ``packed`` (fp16-packed) or ``dense`` with ``biases`` (float32; ``packed`` is then empty).
    ``sizes``: query heads, KV heads, head size, intermediate size. ``kernel``: RoPE with the cache write,
    attention, silu * up and each residual add with the next norm through rayrl's kernels
    (decode_kernels.py) rather than torch's ops (SDPA)."""
    heads, kv_heads, dim, inter = sizes[0], sizes[1], sizes[2], sizes[3]
    n, hidden = x.size(0), x.size(1)
    qk_heads, group, half = heads + kv_heads, heads // kv_heads, dim // 2
    layers = len(new_cols)
    h = torch.rms_norm(x, [hidden], norms[0], eps)
    for i in range(layers):
        qkv = _matmul(h, 4 * i, packed, dense, biases).view(n, qk_heads + kv_heads, dim)
        qk = qkv.narrow(1, 0, qk_heads)
        if len(qk_norms) > 0:
            qk[:, :heads] = torch.rms_norm(qk[:, :heads], [dim], qk_norms[2 * i], eps)
            qk[:, heads:] = torch.rms_norm(qk[:, heads:], [dim], qk_norms[2 * i + 1], eps)
        q = qkv.narrow(1, 0, heads).view(n, kv_heads, group, dim)
        if kernel:  # RoPE on q (in place) and k, k and v into the cache column; attention
            torch.ops.rayrl.rope_cache(qkv, cos, sin, new_cols[i], heads)
            att = torch.ops.rayrl.decode_attention(q, keys[i], values[i], mask, scale)
        else:
            torch.addcmul(qk * cos, qk.roll(half, -1), sin, out=qk)  # RoPE, in place: qkv is [q, k, v] again
            new_cols[i].copy_(qkv.narrow(1, heads, 2 * kv_heads).view(n, 2, kv_heads, dim).transpose(0, 1))
            att = F.scaled_dot_product_attention(q, keys[i], values[i], attn_mask=mask, scale=scale)
        h = _add_norm(x, _matmul(att.view(n, heads * dim), 4 * i + 1, packed, dense, biases), norms[2 * i + 1],
                      eps, kernel)
        gate_up = _matmul(h, 4 * i + 2, packed, dense, biases)
        if kernel:
            gate = torch.ops.rayrl.silu_mul(gate_up)
        else:
            gate = F.silu(gate_up.narrow(1, 0, inter), inplace=True).mul_(gate_up.narrow(1, inter, inter))
        down = _matmul(gate, 4 * i + 3, packed, dense, biases)
        if i + 1 < layers:  # the residual add with the next layer's input norm
            h = _add_norm(x, down, norms[2 * i + 2], eps, kernel)
        else:
            x += down
    return x


@functools.lru_cache(maxsize=1)
def decoder_layers() -> Any:
    """:func:`_decoder_layers` compiled by TorchScript (once per process, on first use, about 0.1 s).
    Where it cannot be compiled (a torch build without the quantized packed-weight class), the same
    function runs as Python, slower by the per-op overhead; that is logged once."""
    try:
        return torch.jit.script(_decoder_layers)
    except Exception as err:  # the function is valid Python either way
        logger.warning("the lean decode step runs as Python: TorchScript could not compile it (%s: %s)",
                       type(err).__name__, err)
        return _decoder_layers


@dataclass
class _Layer:
    """One decoder layer as the step uses it. Norm weights are the model's own (updated in place)."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: Optional[torch.Tensor]  # Qwen3 normalises each query/key head before RoPE
    k_norm: Optional[torch.Tensor]
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


class LeanDecoder:
    """One decode step for the running batch, over the model's weights in format ``weight_format``."""

    def __init__(self, model: Any, weight_format: str, max_positions: int) -> None:
        cfg = model.config
        self.model = model
        self.base = model.model
        attn = self.base.layers[0].self_attn
        self.q_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = int(attn.head_dim)
        self.group = self.q_heads // self.kv_heads
        self.scale = float(attn.scaling)
        self.hidden = int(cfg.hidden_size)
        self.intermediate = int(cfg.intermediate_size)
        self.eps = float(cfg.rms_norm_eps)
        self.qk_width = (self.q_heads + self.kv_heads) * self.head_dim
        fuse_projections(model)
        self.cos, self.sin = self._rope_table(max_positions)
        self.weight_format = ""
        self.layers: list[_Layer] = []
        self.head: Optional[Linear] = None
        self.pack_seconds = 0.0  # the last (re)packing
        self._run_layers: Any = decoder_layers()  # the step's layers (TorchScript), with these arguments:
        self.kernel = decode_kernels_available()  # the step on rayrl's kernels (else torch's ops, SDPA)
        self._norms: list[torch.Tensor] = []  # flattened from self.layers after every (re)packing
        self._qk_norms: list[torch.Tensor] = []
        self._packed: list[Any] = []  # fp16-packed
        self._dense: list[torch.Tensor] = []  # float32
        self._biases: list[Optional[torch.Tensor]] = []
        self._sizes = [self.q_heads, self.kv_heads, self.head_dim, self.intermediate]
        self.pack(weight_format)

    # ------------------------------------------------------------------ weights

    def _rope_table(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[positions, head_dim]`` from the model's rotary module: rotating
        half the dimensions then becomes ``x * cos + roll(x, half) * sin``."""
        rotary = self.base.rotary_emb
        probe = torch.zeros(1, dtype=torch.float32)
        cos, sin = [], []
        for start in range(0, positions, ROPE_CHUNK):
            ids = torch.arange(start, min(start + ROPE_CHUNK, positions)).view(1, -1)
            c, s = rotary(probe, ids)
            cos.append(c[0])
            sin.append(s[0])
        cos_t, sin_t = torch.cat(cos).float().contiguous(), torch.cat(sin).float().contiguous()
        sin_t[:, : self.head_dim // 2] *= -1
        return cos_t, sin_t

    def pack(self, weight_format: str) -> float:
        """(Re)build every layer and the head in ``weight_format``; returns the seconds it took."""
        started = time.perf_counter()
        layers = list(range(len(self.base.layers)))
        built = self._build(layers, weight_format, head=True)
        self.layers = [built[i] for i in layers]
        self.weight_format = weight_format
        self._flatten()
        self.pack_seconds = time.perf_counter() - started
        return self.pack_seconds

    def _flatten(self) -> None:
        """The step's per-layer arguments, from ``self.layers`` (after every (re)packing)."""
        self._norms = [w for layer in self.layers for w in (layer.in_norm, layer.post_norm)]
        self._qk_norms = [w for layer in self.layers if layer.q_norm is not None
                          for w in (layer.q_norm, layer.k_norm)]
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        packed = self.weight_format == "fp16-packed"
        self._packed = [lin.packed for lin in linears] if packed else []
        self._dense = [] if packed else [lin.weight for lin in linears]
        self._biases = [] if packed else [lin.bias for lin in linears]

    def repack(self, names: Iterable[str]) -> float:
        """After a weight update of ``names`` (HF names): rebuild what holds a copy of them. Dense
        weights are the model's own, so only the packed format has work to do. Returns seconds."""
        if self.weight_format == "float32":
            self.pack_seconds = 0.0
            return 0.0
        started = time.perf_counter()
        layers, head = self.touched(names)
        built = self._build(sorted(layers), self.weight_format, head)
        for i, layer in built.items():
            if isinstance(i, int):
                self.layers[i] = layer
        self._flatten()
        self.pack_seconds = time.perf_counter() - started
        return self.pack_seconds

    def touched(self, names: Iterable[str]) -> tuple[set[int], bool]:
        """Layers whose matmul weights ``names`` include, and whether the head's does."""
        layers: set[int] = set()
        head = False
        for name in names:
            parts = name.split(".")
            if "layers" in parts:
                at = parts.index("layers")
                if at + 1 < len(parts) and parts[at + 1].isdigit() and name.endswith(("proj.weight", "proj.bias")):
                    layers.add(int(parts[at + 1]))
            elif name in ("lm_head.weight", "model.embed_tokens.weight"):
                head = True
        return layers, head

    def _build(self, layers: list[int], fmt: str, head: bool) -> dict[Any, Any]:
        """Layers ``layers`` (and the head) in format ``fmt``, packed in parallel over matrices."""
        jobs: dict[tuple[Any, str], tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        for i in layers:
            layer = self.base.layers[i]
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            bias = None if attn.q_proj.bias is None else _fused_view([m.bias for m in qkv])
            jobs[(i, "qkv")] = (_fused_view([m.weight for m in qkv]), bias)
            jobs[(i, "o")] = (attn.o_proj.weight, attn.o_proj.bias)
            jobs[(i, "gate_up")] = (_fused_view([mlp.gate_proj.weight, mlp.up_proj.weight]), None)
            jobs[(i, "down")] = (mlp.down_proj.weight, None)
        head_parts = 0
        if head:
            weight = self.model.get_output_embeddings().weight
            if fmt == "fp16-packed":  # packed in blocks (Fp16PackedChunks), each block one job
                for part in weight.split(HEAD_CHUNK):
                    jobs[("head", head_parts)] = (part, None)
                    head_parts += 1
            else:
                jobs[("head", "head")] = (weight, None)
        keys = list(jobs)
        workers = max(1, min(torch.get_num_threads(), len(keys)))
        if fmt == "float32" or workers == 1:
            made = [make_linear(fmt, *jobs[k]) for k in keys]
        else:  # FBGEMM packs one matrix on one thread (and releases the GIL): one matrix per core
            with ThreadPoolExecutor(workers, thread_name_prefix="rayrl-pack") as pool:
                made = list(pool.map(lambda k: make_linear(fmt, *jobs[k]), keys))
        linears = dict(zip(keys, made))
        out: dict[Any, Any] = {}
        for i in layers:
            layer = self.base.layers[i]
            attn = layer.self_attn
            q_norm = getattr(attn, "q_norm", None)
            k_norm = getattr(attn, "k_norm", None)
            out[i] = _Layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
                linears[(i, "qkv")], linears[(i, "o")], linears[(i, "gate_up")], linears[(i, "down")],
            )
        if head_parts:
            self.head = Fp16PackedChunks([linears[("head", i)] for i in range(head_parts)])
        elif head:
            self.head = linears[("head", "head")]
        return out

    @property
    def attention(self) -> str:
        """What the step's attention (and RoPE, silu, norms) runs on: ``rayrl-kernels`` (decode_kernels.py)
        or ``sdpa`` (torch's ops)."""
        return "rayrl-kernels" if self.kernel else "sdpa"

    def packed_bytes(self) -> int:
        """Bytes held beyond the model's own weights (the packed copies)."""
        total = self.head.nbytes if self.head is not None else 0
        for layer in self.layers:
            total += layer.qkv.nbytes + layer.o.nbytes + layer.gate_up.nbytes + layer.down.nbytes
        return total

    # ------------------------------------------------------------------ prefill

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, mask: Optional[torch.Tensor],
                past: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]], all_logits: bool):
        """Prompt tokens ``ids`` ``[n, T]`` at ``positions`` ``[n, T]``, over ``past`` keys/values per layer
        (``[n, kv_heads, P, head_dim]``, or None). ``mask``: ``[n, 1, T, P + T]`` boolean (True = attend), or
        None for plain causal attention without a past. Returns the logits (``[n, T, vocab]`` when
        ``all_logits``, else the last column's ``[n, 1, vocab]``) and every layer's keys and values over the
        past and new columns, as prefill.py's transformers forward does."""
        n, t = ids.shape
        heads, kv_heads, dim, half = self.q_heads, self.kv_heads, self.head_dim, self.head_dim // 2
        eps, width, inter = self.eps, self.qk_width, self.intermediate
        q_width, kv_width = heads * dim, kv_heads * dim
        norm_shape, head_shape = (self.hidden,), (dim,)
        cos = self.cos[positions].view(n, t, 1, dim)
        sin = self.sin[positions].view(n, t, 1, dim)
        x = F.embedding(ids, self.base.embed_tokens.weight)
        keys_out: list[torch.Tensor] = []
        values_out: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, norm_shape, layer.in_norm, eps)
            qkv = layer.qkv(h)
            qk = qkv[..., :width].view(n, t, heads + kv_heads, dim)
            if layer.q_norm is not None:
                qk[:, :, :heads] = F.rms_norm(qk[:, :, :heads], head_shape, layer.q_norm, eps)
                qk[:, :, heads:] = F.rms_norm(qk[:, :, heads:], head_shape, layer.k_norm, eps)
            torch.addcmul(qk * cos, qk.roll(half, -1), sin, out=qk)
            q = qkv[..., :q_width].view(n, t, heads, dim).transpose(1, 2)
            k = qkv[..., q_width : q_width + kv_width].view(n, t, kv_heads, dim).transpose(1, 2)
            v = qkv[..., q_width + kv_width :].view(n, t, kv_heads, dim).transpose(1, 2)
            if past is not None:
                k, v = torch.cat([past[0][i], k], dim=2), torch.cat([past[1][i], v], dim=2)
            keys_out.append(k)
            values_out.append(v)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                                 scale=self.scale, enable_gqa=kv_heads != heads)
            x = x + layer.o(att.transpose(1, 2).reshape(n, t, q_width))
            h = F.rms_norm(x, norm_shape, layer.post_norm, eps)
            gate_up = layer.gate_up(h)
            x = x + layer.down(F.silu(gate_up[..., :inter]) * gate_up[..., inter:])
        x = F.rms_norm(x if all_logits else x[:, -1:], norm_shape, self.base.norm.weight, eps)
        assert self.head is not None
        return self.head(x), keys_out, values_out

    # ------------------------------------------------------------------ the step

    def step(self, ids: torch.Tensor, positions: torch.Tensor, kv: BatchKV, rows: slice,
             mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Logits ``[n, vocab]`` (float32) of the next token for cache rows ``rows`` (``n`` of them),
        whose last tokens are ``ids`` ``[n]`` at ``positions`` ``[n]``. Writes their keys and values
        at column ``kv.length``; ``mask`` ``[n, 1, 1, length + 1]`` (True = attend) or None (no padding).
        Rows outside ``rows`` are not touched, so a step can be run for part of the batch.

        At batch 1 a step is about 20 ops per layer of a few microseconds each, so their count and the
        Python around them are what this loop minimises: the cache views of every layer are taken once
        per step (one buffer for all layers, kv_cache.BatchKV.all_kv), a padding mask is converted once,
        and the layers run as one TorchScript call (:func:`_decoder_layers`)."""
        n = ids.shape[0]
        col, dim = kv.length, self.head_dim
        cos = self.cos.index_select(0, positions).view(n, 1, dim)
        sin = self.sin.index_select(0, positions).view(n, 1, dim)
        if kv.all_kv is not None:  # every layer's new column and attention views, one op each
            window = kv.all_kv[:, :, rows]
            new_cols = list(window[:, :, :, :, col].unbind(0))
            keys = list(window[:, 0, :, :, : col + 1].unbind(0))
            values = list(window[:, 1, :, :, : col + 1].unbind(0))
        else:
            new_cols = [b[:, rows, :, col] for b in kv.kv_buffers]
            keys = [b[0, rows, :, : col + 1] for b in kv.kv_buffers]
            values = [b[1, rows, :, : col + 1] for b in kv.kv_buffers]
        if mask is not None and mask.dtype == torch.bool:  # SDPA would convert it in every layer
            mask = torch.zeros(mask.shape, dtype=self.cos.dtype).masked_fill_(mask.logical_not(), float("-inf"))
        x = F.embedding(ids, self.base.embed_tokens.weight)
        x = self._run_layers(x, cos, sin, mask, new_cols, keys, values, self._norms, self._qk_norms, self._packed,
                             self._dense, self._biases, self._sizes, self.eps, self.scale, self.kernel)
        x = F.rms_norm(x, (self.hidden,), self.base.norm.weight, self.eps)
        assert self.head is not None
        return self.head(x)
