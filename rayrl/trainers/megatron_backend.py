"""The Megatron trainer backend: megatron-core models built from a HF checkpoint through mbridge.

What it adds over the torch backend: tensor, pipeline and context parallelism (``trainer.tp_size``,
``pp_size``, ``cp_size``), sequence packing (a micro-batch is one packed sequence in Megatron's THD
format: no padding between samples), the distributed optimizer, and torch_memory_saver regions for
colocation: parameters, gradient buffers, fp32 main parameters and Adam's moments are all allocated
inside the region when the trainer is made (the moments eagerly, by Megatron's own ``init_state_fn``:
Adam would otherwise create them at the first step, outside the region, and ``offload`` would leave
the largest block of trainer memory on the GPU). The loss is the torch backend's: the same helper
(rayrl/rl/objective.py) through :func:`~rayrl.trainers.megatron_packing.packed_loss`, with the
same aggregation over the whole mini-batch on every rank. Megatron's ``calculate_per_token_loss``
divides the summed gradients by the summed trained-token count, which is the mini-batch's global count
TrainerGroup planned (rayrl/rl/updates.py); ``packed_loss`` multiplies by it, so the objective's own
normalisation is what remains. Several optimizer steps per batch, the proximal and reference
log-probs (forward-only passes before the first update; the reference model is a second bridge model,
inside the memory saver's region) and the learning-rate schedule work as in the torch backend.

Data layout: each rank trains the samples it is given, mini-batch by mini-batch as its UpdatePlan
says. TrainerGroup hands every rank of one data-parallel replica (its TP, PP and CP ranks) the same
samples, balanced by tokens over the replicas (rayrl/rl/shard.py, which assumes Megatron's default rank
order; the trainer checks that order at setup). The packing (THD sequences, context-parallel split) is
rayrl/trainers/megatron_packing.py.

Weights for the engines leave through ``bridge.export_weights``: full HF-named tensors, gathered across
TP/PP. Every rank must drain that generator (it runs collectives); rank 0 sends what it yields.

The layers are Transformer Engine's (mbridge's own spec) or, with ``trainer.megatron_layer_spec: local``,
megatron-core's plain modules, for machines without TE (rayrl/trainers/megatron_bridge.py: mbridge's load
and export, renamed for the local spec's norms; one sample per micro-batch, since the local attention
takes no packed sequences). Checkpoints are rayrl/trainers/megatron_checkpoint.py.

Nothing here is imported unless ``trainer.backend`` is ``megatron``; :func:`require_megatron` names what
is missing. The packing and the loss path are plain torch and are tested on CPU
(tests/trainers/test_megatron_packing.py); the trainer itself runs only on CUDA (tests/gpu/).
"""

from __future__ import annotations

import importlib
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from rayrl.config import AlgorithmConfig, TrainerConfig
from rayrl.rl.objective import STATS, Objective, loss_metrics
from rayrl.rl.shard import dp_rank_of
from rayrl.rl.updates import MiniBatch, UpdatePlan, plan_updates
from rayrl.trainers import megatron_checkpoint
from rayrl.trainers.lr_schedule import lr_at, set_lr
from rayrl.trainers.megatron_bridge import make_bridge
from rayrl.trainers.megatron_packing import (
    PackedBatch,
    empty_batch,
    micro_batches_by_tokens,
    pack_samples,
    packed_loss,
    sharded_entropy,
    split_for_context_parallel,
)
from rayrl.trainers.memory_saver import MemorySaver, init_optimizer_state
from rayrl.types import Sample

logger = logging.getLogger(__name__)

# trainer.lora is refused at load for this backend (rayrl/config/training.py): megatron-core 0.15.3 and
# mbridge 0.15.1 have no LoRA adapter (their "lora" names are MLA's q/kv ranks and NeMo's grad-reduce hook)
_NO_LORA = "trainer.lora: the Megatron backend trains full weights only; there is no adapter"

_REQUIREMENTS = (
    ("megatron.core", "megatron-core"),
    ("mbridge", "mbridge"),
    ("transformer_engine.pytorch", "transformer-engine[pytorch]"),  # not for trainer.megatron_layer_spec local
)


class MegatronUnavailable(RuntimeError):
    """trainer.backend=megatron on a machine without CUDA or without the Megatron packages."""


def require_megatron(layer_spec: str = "transformer_engine") -> None:
    """Raise MegatronUnavailable naming every missing piece (packages, CUDA) for ``layer_spec``."""
    missing = []
    for module, package in _REQUIREMENTS:
        if layer_spec == "local" and module.startswith("transformer_engine"):
            continue
        try:
            importlib.import_module(module)
        except ImportError as err:
            missing.append(f"{package} (import {module}: {err})")
    if missing:
        raise MegatronUnavailable(
            "trainer.backend=megatron needs " + "; ".join(missing) + ". Install the GPU extra "
            "(pip install 'rayrl[gpu]', or use cluster/Dockerfile), or set trainer.backend=torch"
            + ("" if layer_spec == "local" else " (or trainer.megatron_layer_spec=local without Transformer Engine)")
            + "."
        )
    if not torch.cuda.is_available():
        raise MegatronUnavailable("trainer.backend=megatron needs a CUDA GPU; use trainer.backend=torch here")


# --------------------------------------------------------------------------------------------------
# The trainer (CUDA + megatron-core + mbridge + Transformer Engine)


def logp_and_entropy(logits: torch.Tensor, targets: torch.Tensor,
                     entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of every position's target from vocabulary-parallel ``logits`` (Megatron's
    ``vocab_parallel_cross_entropy``, which works on its input in place: it gets a copy when the entropy
    still needs the logits) and, on request, the entropy there (all-reduced over the tensor-parallel
    group with the gradient passed through). Runs wherever megatron-core's parallel state is set up,
    on CPU too (tests/trainers/test_megatron_packing.py)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = logits.float()
    logp_all = -vocab_parallel_cross_entropy((z.clone() if entropy else z).contiguous(), targets)
    if not entropy:
        return logp_all, None

    def max_over_shards(t: torch.Tensor) -> torch.Tensor:
        if mpu.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
        return t

    return logp_all, sharded_entropy(z, reduce_from_tensor_model_parallel_region, max_over_shards)


class MegatronTrainer:
    """RL training on megatron-core; one instance per rank, all ranks in one torch.distributed world."""

    def __init__(
        self,
        model_path: str | Path,
        cfg: TrainerConfig,
        *,
        algorithm: Optional[AlgorithmConfig] = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        local_rank: Optional[int] = None,
    ) -> None:
        require_megatron(cfg.megatron_layer_spec)
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.utils import get_model_config

        self.cfg = cfg
        self.algorithm = algorithm if algorithm is not None else AlgorithmConfig()
        self.objective = Objective(self.algorithm)
        self.rank = rank
        self.world_size = world_size
        device = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(device)
        if not dist.is_initialized():  # a single process (tests); Ray ranks arrive with the world made
            dist.init_process_group("nccl", rank=rank, world_size=world_size)
        if not mpu.model_parallel_is_initialized():
            mpu.initialize_model_parallel(
                tensor_model_parallel_size=cfg.tp_size,
                pipeline_model_parallel_size=cfg.pp_size,
                context_parallel_size=cfg.cp_size,
            )
        expected = dp_rank_of(rank, world_size, cfg.tp_size, cfg.pp_size, cfg.cp_size)
        if mpu.get_data_parallel_rank() != expected:
            raise RuntimeError(
                f"rank {rank}: Megatron put it in data-parallel replica {mpu.get_data_parallel_rank()}, but "
                f"TrainerGroup sends it replica {expected}'s samples (rayrl/rl/shard.py assumes Megatron's "
                "default rank order tp-cp-ep-dp-pp); the ranks of a replica would train different data"
            )
        model_parallel_cuda_manual_seed(seed)
        random.seed(seed + rank)
        np.random.seed(seed + rank)
        self.mpu = mpu
        self.align = cfg.tp_size * (2 * cfg.cp_size if cfg.cp_size > 1 else 1)
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        self.packed = cfg.megatron_layer_spec != "local"  # the local spec's attention takes no THD sequences
        self.bridge = make_bridge(str(model_path), cfg.megatron_layer_spec, dtype=dtype)
        extra: dict[str, Any] = {"calculate_per_token_loss": True}
        if cfg.gradient_checkpointing:
            extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        self.bridge.set_extra_args(**extra)

        self.memory = MemorySaver(cfg.memory_saver, tag="trainer")
        with self.memory.region():  # parameters, gradient buffers and optimizer state: all pauseable, kept
            self.model = self.bridge.get_model(
                weight_path=str(model_path),
                wrap_with_ddp=True,
                bf16=dtype is torch.bfloat16,
                ddp_config={
                    "grad_reduce_in_fp32": True,
                    "use_distributed_optimizer": cfg.distributed_optimizer,
                    "overlap_grad_reduce": False,
                },
            )
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=cfg.lr,
                    min_lr=cfg.lr,
                    weight_decay=cfg.weight_decay,
                    adam_beta1=cfg.betas[0],
                    adam_beta2=cfg.betas[1],
                    clip_grad=cfg.grad_clip if cfg.grad_clip > 0 else 0.0,
                    bf16=dtype is torch.bfloat16,
                    params_dtype=dtype,
                    use_distributed_optimizer=cfg.distributed_optimizer,
                ),
                self.model,
            )
            if self.memory.active:  # Adam's moments now, inside the region, not at the first step
                init_optimizer_state(self.optimizer)
            self.reference = self._load_reference(model_path, dtype) if self.objective.uses_reference else None
        config = get_model_config(self.model[0])
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        self.policy_version = 0
        self.optimizer_steps = 0  # over the whole run: where the learning-rate schedule is

    def _load_reference(self, model_path: str | Path, dtype: torch.dtype) -> list[Any]:
        """The frozen reference policy (``algorithm.reference_path``, default the initial weights): the
        same architecture through the same bridge, without DDP or an optimizer."""
        from rayrl.models import resolve_model_path

        path = self.algorithm.reference_path
        source = str(model_path) if path is None else str(resolve_model_path(path))
        chunks = self.bridge.get_model(weight_path=source, wrap_with_ddp=False, bf16=dtype is torch.bfloat16)
        for chunk in chunks:
            chunk.eval()
            chunk.requires_grad_(False)
        return chunks

    # -- training ----------------------------------------------------------------------------------

    def _forward_step(self, loss_fn: Any, data_iterator: Iterator[PackedBatch], model: Any) -> tuple[torch.Tensor, Any]:
        batch: PackedBatch = next(data_iterator)
        return self._logits(model, batch), lambda logits: loss_fn(batch, logits)

    def _logits(self, model: Any, batch: PackedBatch) -> torch.Tensor:
        """``model`` over one micro-batch: THD-packed, or (the local layer spec, which config keeps to one
        sample per micro-batch) a plain sequence under the causal mask, its padding after the sample."""
        from megatron.core.packed_seq_params import PackedSeqParams

        if not self.packed:
            if len(batch.cu_seqlens) > 2:
                raise ValueError("the local layer spec runs one sample per micro-batch (no packed sequences)")
            return model(input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=None)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch.cu_seqlens, cu_seqlens_kv=batch.cu_seqlens,
                                 max_seqlen_q=batch.max_seqlen, max_seqlen_kv=batch.max_seqlen)  # fmt: skip
        return model(input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=None,
                     packed_seq_params=packed)

    def _train_loss(self, global_tokens: int) -> Any:
        def loss_fn(batch: PackedBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            logp_all, entropy_all = logp_and_entropy(logits, batch.targets, self.objective.uses_entropy)
            return packed_loss(self.objective, batch, logp_all, global_tokens, entropy_all)
        return loss_fn

    @staticmethod
    def _collect_logp(batch: PackedBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        logp_all, _ = logp_and_entropy(logits, batch.targets, entropy=False)
        keep = batch.loss_mask[0].bool()
        return logp_all.sum() * 0.0, keep.sum().to(torch.int), {"logp": logp_all[0, keep].detach()}

    def _run(self, model: list[Any], batches: list[PackedBatch], loss_fn: Any, forward_only: bool) -> list[dict]:
        """Megatron's forward(-backward) schedule over ``batches``; the loss functions' dicts (last stage)."""
        from functools import partial

        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, loss_fn),
            data_iterator=iter(batches),
            model=model,
            num_microbatches=len(batches),
            seq_length=max(b.tokens.shape[1] for b in batches),
            micro_batch_size=1,
            forward_only=forward_only,
        ) or []

    @torch.no_grad()
    def _no_grad_passes(self, steps: list[list[PackedBatch]], proximal: bool) -> None:
        """Before any update: reference log-probs (a KL is on) and, with several optimizer steps, the
        policy's own (proximal; the step's first forward), on the last pipeline stage where the loss is."""
        last = self.mpu.is_pipeline_last_stage(ignore_virtual=True)
        for batches in steps:
            if self.reference is not None:
                for b, out in zip(batches, self._run(self.reference, batches, self._collect_logp, True)):
                    b.ref_logp = out["logp"] if last else None
            if proximal:
                for b, out in zip(batches, self._run(self.model, batches, self._collect_logp, True)):
                    b.proximal = out["logp"] if last else None
                    if last:
                        self.objective.record(b.proximal, b.token_batch())
        if proximal:
            self.objective.close_first_forward()

    def _pack_step(self, samples: list[Sample], advantages: Sequence[Any], mb: MiniBatch,
                   device: torch.device) -> list[PackedBatch]:
        """The micro-batches of one mini-batch, packed and cut for this CP rank (fixed for the step)."""
        chosen = [samples[i] for i in mb.indices]
        adv = [advantages[i] for i in mb.indices]
        if self.cfg.sequence_packing:  # several samples per micro-batch, packed back to back
            groups = micro_batches_by_tokens([len(s.tokens) for s in chosen], self.cfg.micro_batch_tokens)
        else:  # one sample per micro-batch
            groups = [[i] for i in range(len(chosen))]
        cp_size, cp_rank = self.mpu.get_context_parallel_world_size(), self.mpu.get_context_parallel_rank()
        out = []
        for g in groups:
            part = [chosen[i] for i in g]
            fields = self.objective.token_fields(part, [adv[i] for i in g], mb)
            out.append(split_for_context_parallel(pack_samples(part, fields, self.align).to(device), cp_size, cp_rank))
        # pipeline stages of one replica must agree on the number of micro-batches: they hold the same samples
        return out or [empty_batch(self.align).to(device)]

    def train_step(
        self, samples: list[Sample], advantages: Sequence[float | np.ndarray], plan: Optional[UpdatePlan] = None
    ) -> dict[str, Any]:
        """Train one rollout batch on this rank's samples (every rank of one replica gets the same, in the
        same order, rayrl/rl/shard.py) as ``plan`` says; without a plan, what trains of ``samples`` in one
        mini-batch counted locally (a single data-parallel replica)."""
        import torch.distributed as dist

        started = time.monotonic()
        if plan is None:
            (keep, plan), = plan_updates(samples, advantages, self.algorithm)
            samples, advantages = [samples[i] for i in keep], [advantages[i] for i in keep]
        device = torch.device("cuda", torch.cuda.current_device())
        self.objective.begin_step(self.policy_version)
        steps = [self._pack_step(samples, advantages, mb, device) for mb in plan.minibatches]
        self._no_grad_passes(steps, self.objective.needs_prepass(plan))
        stats = torch.zeros(len(STATS), device=device)
        grad_norms, lr, updates_ok = [], self.cfg.lr, True
        for _ in range(plan.epochs):
            for batches, mb in zip(steps, plan.minibatches):
                for m in self.model:
                    m.train()
                    m.zero_grad_buffer()
                self.optimizer.zero_grad()
                reduced = self._run(self.model, batches, self._train_loss(mb.tokens), forward_only=False)
                lr = lr_at(self.optimizer_steps, self.cfg)
                set_lr(self.optimizer, lr)
                update_ok, grad_norm, _ = self.optimizer.step()
                self.optimizer_steps += 1
                self.objective.close_first_forward()
                updates_ok = updates_ok and bool(update_ok)
                grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
                for item in reduced:
                    stats += item["stats"]
        self.policy_version += 1
        # loss statistics live on the last pipeline stage: sum them over data-parallel ranks, then share
        if self.mpu.is_pipeline_last_stage(ignore_virtual=True):
            dist.all_reduce(stats, group=self.mpu.get_data_parallel_group(with_context_parallel=True))
        if self.mpu.get_pipeline_model_parallel_world_size() > 1:
            last = self.mpu.get_pipeline_model_parallel_last_rank()
            dist.broadcast(stats, src=last, group=self.mpu.get_pipeline_model_parallel_group())
        sums = dict(zip(STATS, stats.tolist()))  # summed over every data-parallel replica
        planned = sum(mb.tokens for mb in plan.minibatches) * plan.epochs
        if int(round(sums["tokens"])) != planned:  # Megatron divided the gradients by a different count
            logger.error("rank %d: the loss saw %d trained tokens over the replicas, the plan has %d: the "
                         "gradient scale is off", self.rank, int(sums["tokens"]), planned)
        return {
            **loss_metrics(sums, plan.optimizer_steps),
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
            "update_successful": updates_ok,
            "lr": lr,
            "optimizer_steps": plan.optimizer_steps,
            "trained_tokens": sum(s.num_trained_tokens for s in samples),  # this replica's: summed per replica
            "trained_samples": len(samples),
            "micro_batches": sum(len(b) for b in steps),
            "train_time_s": time.monotonic() - started,
            "policy_version": self.policy_version,
            **self.objective.gap_stats(device=device),
        }

    @torch.no_grad()
    def token_logprobs(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """Log-probs of each sample's response tokens (every response token, trained or not), on a
        single model-parallel group without PP (tests compare them with the HF model and the engines):
        all samples in one packed sequence, or one at a time on the local layer spec."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        if self.mpu.get_pipeline_model_parallel_world_size() > 1 or self.mpu.get_context_parallel_world_size() > 1:
            raise NotImplementedError("token_logprobs runs without pipeline or context parallelism")
        device = torch.device("cuda", torch.cuda.current_device())
        full = [Sample(tokens=s.tokens, prompt_length=s.prompt_length,
                       loss_mask=np.ones(len(s.tokens) - s.prompt_length, np.int8),
                       rollout_logprobs=np.zeros(len(s.tokens) - s.prompt_length, np.float32),
                       policy_versions=np.zeros(len(s.tokens) - s.prompt_length, np.int32))
                for s in samples]  # fmt: skip
        for m in self.model:
            m.eval()
        flat = []
        for part in ([full] if self.packed else [[s] for s in full]):
            batch = pack_samples(part, None, self.align).to(device)
            logits = self._logits(self.model[0], batch)
            logp = -vocab_parallel_cross_entropy(logits.float().contiguous(), batch.targets)[0]
            flat.append(logp[batch.loss_mask[0].bool()].cpu().numpy())
        out, start, joined = [], 0, np.concatenate(flat)
        for s in full:
            n = len(s.tokens) - s.prompt_length
            out.append(joined[start : start + n])
            start += n
        return out

    # -- weights for the engines -------------------------------------------------------------------

    def named_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors (gathered over TP/PP), on the GPU. EVERY rank must iterate this to the end."""
        for name, tensor in self.bridge.export_weights(self.model):
            yield name, (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor)

    # -- checkpoints (rayrl/trainers/megatron_checkpoint.py) ----------------------------------------

    def adapter_config(self) -> dict[str, Any]:
        raise ValueError(_NO_LORA)

    def export_adapter(self, directory: str | Path) -> Path:
        raise ValueError(_NO_LORA)

    def export_merged(self, directory: str | Path, dtype: Optional[torch.dtype] = None) -> Path:
        raise ValueError("export_merged: the Megatron backend's weights are exported by mbridge (named_weights)")

    def save_checkpoint(self, directory: str | Path, as_rank: Optional[int] = None) -> None:
        """Megatron distributed checkpoint (model + optimizer, resharding-capable) and this rank's RNG
        and policy version. ``as_rank`` (the protocol's whole-checkpoint-from-one-rank, rayrl/trainers/
        backend.py) is refused for any other rank: the state is sharded over the ranks and the checkpoint
        is one collective write of all of them (TrainerGroup never asks: full_state_on_every_rank)."""
        if as_rank is not None and as_rank != self.rank:
            raise ValueError(f"as_rank={as_rank} on Megatron rank {self.rank}: a distributed checkpoint is "
                             "written by every rank together; one rank cannot write another's part")
        megatron_checkpoint.save(Path(directory), self.model, self.optimizer, self.rank,
                                 {"policy_version": self.policy_version, "optimizer_steps": self.optimizer_steps})

    def load_checkpoint(self, directory: str | Path) -> None:
        counters = megatron_checkpoint.load(Path(directory), self.model, self.optimizer, self.rank)
        self.memory.adopt_optimizer_state(self.optimizer)  # loaded state that landed outside the region
        self.policy_version = counters["policy_version"]
        self.optimizer_steps = counters.get("optimizer_steps", self.policy_version)  # older: one per version

    # -- colocation --------------------------------------------------------------------------------

    def offload(self) -> bool:
        """Release parameters, gradients and optimizer state (contents kept in pinned host memory) so
        engines get the GPU; False when a no-op (``trainer.memory_saver`` off)."""
        return self.memory.pause()

    def onload(self) -> bool:
        """Map them back, contents restored bit for bit."""
        return self.memory.resume()
