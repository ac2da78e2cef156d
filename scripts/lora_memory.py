"""The memory arithmetic of docs/lora.md: trainer state per parameter, full weights against LoRA, for
models from 0.5B to 72B, on CPU (rayrl's torch backend, float32) and on 8xH100 (bfloat16, sharded 8 ways).

Only SmolLM2-135M ships in a package here, so the larger models are their published config.json shapes
(hidden size, MLP size, layers, KV width, vocabulary), typed in below. Prints markdown.

    python scripts/lora_memory.py [--rank 16]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    mlp: int
    layers: int
    kv: int  # key/value width: KV heads x head size
    vocab: int
    tied: bool

    def params(self) -> int:
        per_layer = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv + 3 * self.hidden * self.mlp
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2)

    def adapter(self, rank: int) -> int:
        """LoRA on the seven projections of every layer: r x (in + out) each."""
        h, kv, m = self.hidden, self.kv, self.mlp
        return self.layers * rank * (2 * h + 2 * (h + kv) + 2 * h + 2 * (h + m) + (m + h))


MODELS = [
    Shape("SmolLM2-135M", 576, 1536, 30, 3 * 64, 49152, True),
    Shape("Qwen2.5-0.5B", 896, 4864, 24, 2 * 64, 151936, True),
    Shape("Qwen2.5-7B", 3584, 18944, 28, 4 * 128, 152064, False),
    Shape("Qwen2.5-14B", 5120, 13824, 48, 8 * 128, 152064, False),
    Shape("Qwen2.5-32B", 5120, 27648, 64, 8 * 128, 152064, False),
    Shape("Llama-3.1-70B", 8192, 28672, 80, 8 * 128, 128256, False),
]

# bytes per parameter of the trainer's state (activations and the engines' KV cache come on top)
CPU_FULL = 4 + 4 + 8 + 4  # float32 weights, gradients, AdamW m and v; the reference model's copy (with a KL)
CPU_LORA_BASE = 4  # the frozen base, float32; no gradient, no optimizer state; the reference is this base
GPU_FULL = 2 + 4 + 4 + 8 + 2  # bf16 weights, fp32 main grads, fp32 master weights, AdamW m+v; bf16 reference
GPU_LORA_BASE = 2  # the frozen base in bf16
ADAPTER = 4 + 4 + 8  # each adapter parameter: fp32 weight, gradient, AdamW m and v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    r = args.rank
    print(f"| model | params | adapter r{r} | CPU full | CPU LoRA | 8xH100 full, per GPU | 8xH100 LoRA, per GPU |"
          " checkpoint full | checkpoint LoRA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in MODELS:
        p, a = m.params(), m.adapter(r)
        print(f"| {m.name} | {p / 1e9:.2f} B | {a / 1e6:.1f} M ({100 * a / p:.2f}%) "
              f"| {p * CPU_FULL / GB:.1f} GB | {(p * CPU_LORA_BASE + a * ADAPTER) / GB:.1f} GB "
              f"| {p * GPU_FULL / 8 / GB:.1f} GB | {(p * GPU_LORA_BASE + a * ADAPTER) / 8 / GB:.1f} GB "
              f"| {p * 12 / GB:.1f} GB | {a * 12 / 1e6:.0f} MB |")


if __name__ == "__main__":
    main()
