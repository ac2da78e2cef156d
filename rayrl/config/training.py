"""The config sections of training: the trainer ranks and the GPU placement they share with engines.

Part of the run configuration (rayrl/config/schema.py has the conventions and ``RunConfig``); the
comment beside each field is its documentation (docs/config.md is generated from them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rayrl.config.checks import ConfigError, at_least_one, non_negative, positive

LORA_ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer except the output head


@dataclass
class LoraConfig:
    """LoRA adapters trained with PEFT instead of the full weights (docs/lora.md); rank 0 trains every weight."""

    rank: int = 0  # adapter rank r (0: off, full weights are trained)
    alpha: float = 32.0  # scaling numerator: the adapter's output is multiplied by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input while training
    target_modules: list[str] = field(default_factory=lambda: [LORA_ALL_LINEAR])  # module names (suffixes such as
    # q_proj, down_proj) that get an adapter; all-linear: every linear layer except the output head
    export_merged: bool = False  # at the end of the run, beside the adapter (runs/<exp_id>/adapter, PEFT's format),
    # also write the base with the adapter merged in as a plain HF model (runs/<exp_id>/merged)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def __post_init__(self) -> None:
        non_negative(self, "trainer.lora.", "rank")
        positive(self, "trainer.lora.", "alpha")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"trainer.lora.dropout: must be in [0, 1), got {self.dropout!r}")
        names = list(self.target_modules)
        if not names or not all(isinstance(n, str) and n.strip() for n in names):
            raise ConfigError(f"trainer.lora.target_modules: need one or more module names, got {names!r}")
        if LORA_ALL_LINEAR in names and len(names) > 1:
            raise ConfigError(f"trainer.lora.target_modules: {LORA_ALL_LINEAR} already names every linear layer; "
                              f"give it alone, got {names!r}")


@dataclass
class TrainerConfig:
    """Policy optimisation."""

    backend: Literal["torch", "megatron"] = "torch"  # torch (CPU or GPU) | megatron (GPU: megatron-core + mbridge,
    # rayrl[gpu])
    num_ranks: int = 1  # trainer ranks in the placement group (torch.distributed)
    steps: int = 12  # training steps (one rollout batch each)
    lr: float = 2.0e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])  # AdamW betas
    grad_clip: float = 1.0  # global gradient-norm clip
    num_steps_per_rollout: int = 1  # optimizer steps per rollout batch: the batch is split into this many mini-batches
    # (the policy version advances once per batch)
    epochs_per_rollout: int = 1  # passes over the rollout batch (each makes num_steps_per_rollout optimizer steps)
    lr_schedule: Literal["constant", "cosine"] = "constant"  # learning rate after warm-up: constant | cosine (decays to
    # lr x lr_min_ratio at the last optimizer step of trainer.steps)
    lr_warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to lr
    lr_min_ratio: float = 0.0  # cosine: the final learning rate as a fraction of lr
    micro_batch_tokens: int = 4096  # tokens per forward/backward micro-batch
    dtype: Literal["float32", "bfloat16"] = "float32"  # master weights dtype
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # torch backend: forward/backward under autocast
    # (mixed precision; master weights stay trainer.dtype): auto | float32 | bfloat16 (auto: bfloat16 on CUDA or a CPU
    # with native bf16, on x86 AVX512-BF16 or AMX; else float32)
    gradient_checkpointing: bool = False  # trade compute for memory: each decoder layer keeps only its input and runs
    # its forward again in the backward pass (torch backend: the shared prefix is kept)
    share_prefix: bool = True  # torch backend: a micro-batch's common leading tokens (system prompt, a group's prompt)
    # run once, exact gradients
    num_threads: int = 0  # torch CPU threads per rank (0: auto, the cores the schedule gives the trainer)
    tp_size: int = 1  # megatron: tensor-parallel ranks
    pp_size: int = 1  # megatron: pipeline-parallel stages
    cp_size: int = 1  # megatron: context-parallel ranks (long sequences)
    sequence_packing: bool = True  # megatron: a micro-batch is one packed (THD) sequence, no padding
    distributed_optimizer: bool = True  # megatron: shard optimizer state across data-parallel ranks
    megatron_layer_spec: Literal["transformer_engine", "local"] = "transformer_engine"  # megatron: the layers'
    # implementation: transformer_engine (needs Transformer Engine) | local (plain megatron-core modules, where TE is
    # not installed: no packed sequences, so sequence_packing false and cp_size 1; rayrl/trainers/megatron_bridge.py)
    memory_saver: bool = False  # GPU: params, grads and optimizer state in torch_memory_saver regions (colocation)
    memory_saver_standin: bool = False  # tests, torch backend on CPU: offload makes the weights unreadable until
    # onload, as torch_memory_saver's pause does on GPU (rayrl/trainers/memory_standin.py)
    weight_bucket_mb: int = 512  # weights go to the engines in buckets of this size (CUDA IPC / NCCL)
    lora: LoraConfig = field(default_factory=LoraConfig)  # torch backend: train LoRA adapters, not the weights

    def __post_init__(self) -> None:
        positive(self, "trainer.", "num_ranks", "lr", "micro_batch_tokens")
        non_negative(self, "trainer.", "num_threads", "steps", "weight_decay", "grad_clip", "lr_warmup_steps")
        at_least_one(self, "trainer.", "num_steps_per_rollout", "epochs_per_rollout")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"trainer.betas: need two values in [0, 1), got {list(self.betas)}")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ConfigError(f"trainer.lr_min_ratio: must be in [0, 1], got {self.lr_min_ratio!r}")
        at_least_one(self, "trainer.", "tp_size", "pp_size", "cp_size", "weight_bucket_mb")
        model_parallel = self.tp_size * self.pp_size * self.cp_size
        if self.megatron_layer_spec == "local" and (self.sequence_packing or self.cp_size > 1):
            raise ConfigError("trainer.megatron_layer_spec: local has no packed (THD) sequences (Megatron's local "
                              "attention refuses them): set trainer.sequence_packing false and trainer.cp_size 1")
        if self.num_ranks % model_parallel:
            raise ConfigError(f"trainer.num_ranks: {self.num_ranks} is not a multiple of tp_size x pp_size x "
                              f"cp_size ({model_parallel})")


@dataclass
class PlacementConfig:
    """GPU placement: one placement group shared by the trainer ranks and the engines (actors/placement_group.py)."""

    mode: Literal["none", "colocated", "split"] = "none"  # none | colocated | split  (none: each group places itself;
    # CPU runs)
    num_gpus: int = 8  # GPU bundles in the shared placement group
    trainer_gpus: int = 4  # split: bundles that train (the rest serve)
    trainer_gpu_fraction: float = 0.5  # colocated: the share of its GPU a trainer rank claims in Ray (engines get the
    # rest)
    cpus_per_bundle: float = 4.0  # CPUs reserved with each GPU bundle

    def __post_init__(self) -> None:
        non_negative(self, "placement.", "cpus_per_bundle")
