"""The Megatron trainer backend: megatron-core models built from a HF checkpoint through mbridge.

What it adds over the torch backend: tensor, pipeline and context parallelism (``trainer.tp_size``,
``pp_size``, ``cp_size``), sequence packing (a micro-batch is one packed sequence in Megatron's THD
format: no padding between samples), the distributed optimizer, and torch_memory_saver regions for
colocation: parameters, gradient buffers, fp32 main parameters and Adam's moments are all allocated
inside the region when the trainer is made (the moments eagerly, by Megatron's own ``init_state_fn``:
Adam would otherwise create them at the first step, outside the region, and ``offload`` would leave
the largest block of trainer memory on the GPU). The loss is the same function as the torch
backend's (rayrl.trainers.losses), and the semantics are the same: each trained token counts once,
normalised by the trained-token count of the whole batch over all data-parallel ranks (Megatron's
``calculate_per_token_loss``).

Data layout: each rank trains the samples it is given. TrainerGroup hands every rank of one
data-parallel replica (its TP, PP and CP ranks) the same shard, balanced by tokens over the replicas
(rayrl/rl/shard.py, which assumes Megatron's default rank order; the trainer checks that order at setup).

Weights for the engines leave through ``bridge.export_weights``: full HF-named tensors, gathered across
TP/PP. Every rank must drain that generator (it runs collectives); rank 0 sends what it yields.

Nothing here is imported unless ``trainer.backend`` is ``megatron``; :func:`require_megatron` names what
is missing. The packing helpers at the top are plain torch and are tested on CPU
(tests/test_megatron_packing.py); the trainer itself runs only on CUDA (tests/gpu/).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from rayrl.config import TrainerConfig
from rayrl.rl.logprob_gap import GapMeter
from rayrl.rl.shard import dp_rank_of
from rayrl.trainers.losses import ppo_clip_token_loss
from rayrl.trainers.memory_saver import MemorySaver, init_optimizer_state
from rayrl.types import Sample

logger = logging.getLogger(__name__)

_REQUIREMENTS = (
    ("megatron.core", "megatron-core"),
    ("mbridge", "mbridge"),
    ("transformer_engine.pytorch", "transformer-engine[pytorch]"),
)


class MegatronUnavailable(RuntimeError):
    """trainer.backend=megatron on a machine without CUDA or without the Megatron packages."""


def require_megatron() -> None:
    """Raise MegatronUnavailable naming every missing piece (packages, CUDA)."""
    missing = []
    for module, package in _REQUIREMENTS:
        try:
            importlib.import_module(module)
        except ImportError as err:
            missing.append(f"{package} (import {module}: {err})")
    if missing:
        raise MegatronUnavailable(
            "trainer.backend=megatron needs " + "; ".join(missing) + ". Install the GPU extra "
            "(pip install 'rayrl[gpu]', or use cluster/Dockerfile), or set trainer.backend=torch."
        )
    if not torch.cuda.is_available():
        raise MegatronUnavailable("trainer.backend=megatron needs a CUDA GPU; use trainer.backend=torch here")


# --------------------------------------------------------------------------------------------------
# Packing (plain torch; CPU-testable)


@dataclass
class PackedBatch:
    """Samples packed into one sequence (batch dimension 1), every per-position tensor aligned.

    Position ``p`` of a sample predicts its token ``p + 1``: ``targets[p]`` is that token, and
    ``loss_mask[p]`` is 1 where it is a trained response token, with its rollout log-prob and advantage.
    Each sample is padded to a multiple of ``align`` (tensor/context parallel split sizes).
    """

    tokens: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 for each sample
    targets: torch.Tensor  # [1, T] int64
    loss_mask: torch.Tensor  # [1, T] float32
    rollout_logprobs: torch.Tensor  # [1, T] float32
    advantages: torch.Tensor  # [1, T] float32
    cu_seqlens: torch.Tensor  # [n + 1] int32, padded segment boundaries
    max_seqlen: int
    policy_versions: torch.Tensor  # [1, T] int64: the version that sampled each trained token (-1 elsewhere)

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device) -> "PackedBatch":
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items()}  # fmt: skip
        return PackedBatch(**moved)


def pack_samples(samples: Sequence[Sample], advantages: Sequence[float], align: int = 1) -> PackedBatch:
    """One packed sequence from ``samples`` (see :class:`PackedBatch`)."""
    if not samples:
        raise ValueError("pack_samples needs at least one sample")
    seg_lengths = [int(math.ceil(len(s.tokens) / align) * align) for s in samples]
    total = sum(seg_lengths)
    tokens = torch.zeros(total, dtype=torch.long)
    positions = torch.zeros(total, dtype=torch.long)
    targets = torch.zeros(total, dtype=torch.long)
    mask = torch.zeros(total, dtype=torch.float32)
    rollout = torch.zeros(total, dtype=torch.float32)
    adv, versions = torch.zeros(total, dtype=torch.float32), torch.full((total,), -1, dtype=torch.long)
    start = 0
    for s, a, seg in zip(samples, advantages, seg_lengths):
        ids = torch.from_numpy(np.asarray(s.tokens, dtype=np.int64))
        n = len(ids)
        tokens[start : start + n] = ids
        positions[start : start + seg] = torch.arange(seg)
        targets[start : start + n - 1] = ids[1:]
        trained = np.nonzero(np.asarray(s.loss_mask))[0]
        where = start + s.prompt_length + trained - 1  # the position that predicts response token j
        idx = torch.from_numpy(where.astype(np.int64))
        mask[idx] = 1.0
        rollout[idx] = torch.from_numpy(np.asarray(s.rollout_logprobs, dtype=np.float32)[trained])
        adv[idx] = float(a)
        versions[idx] = torch.from_numpy(np.asarray(s.policy_versions, dtype=np.int64)[trained])
        start += seg
    cu = torch.tensor([0, *np.cumsum(seg_lengths)], dtype=torch.int32)
    return PackedBatch(
        tokens=tokens[None], position_ids=positions[None], targets=targets[None], loss_mask=mask[None],
        rollout_logprobs=rollout[None], advantages=adv[None], cu_seqlens=cu, max_seqlen=max(seg_lengths),
        policy_versions=versions[None])  # fmt: skip


def empty_batch(align: int) -> PackedBatch:
    """A batch that trains nothing: a rank whose data-parallel shard is empty still joins the collectives."""
    z = torch.zeros((1, align), dtype=torch.long)
    f = torch.zeros((1, align), dtype=torch.float32)
    return PackedBatch(z, torch.arange(align)[None], z.clone(), f, f.clone(), f.clone(),
                       torch.tensor([0, align], dtype=torch.int32), align, z - 1)  # fmt: skip


def micro_batches_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups whose summed length stays within ``max_tokens`` (packing has no padding cost;
    a longer sample gets a group of its own)."""
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(lengths):
        if current and size + n > max_tokens:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        groups.append(current)
    return groups


def split_for_context_parallel(batch: PackedBatch, cp_size: int, cp_rank: int) -> PackedBatch:
    """This CP rank's share of a packed batch (each segment cut into 2*cp chunks, load-balanced for
    causal attention, as Transformer Engine's THD context parallelism expects)."""
    if cp_size == 1:
        return batch
    import transformer_engine_torch as tex

    total = batch.tokens.shape[1]
    index = tex.thd_get_partitioned_indices(batch.cu_seqlens.cuda(), total, cp_size, cp_rank)
    index = index.to(batch.tokens.device)
    picked = {
        name: getattr(batch, name).index_select(1, index)
        for name in ("tokens", "position_ids", "targets", "loss_mask", "rollout_logprobs", "advantages",
                     "policy_versions")
    }
    return PackedBatch(**picked, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)


# --------------------------------------------------------------------------------------------------
# The trainer (CUDA + megatron-core + mbridge + Transformer Engine)


def _unwrap_for_sharding(module: Any) -> Any:
    """The bare model inside its wrappers (DDP, Float16Module), whose ``sharded_state_dict`` keys are the
    ones ``load_state_dict`` expects (the wrappers forward it to the bare model). DDP is a MegatronModule
    too: its own ``sharded_state_dict`` walks its children and prefixes every key with ``module.``."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


class MegatronTrainer:
    """GRPO/PPO on megatron-core; one instance per rank, all ranks in one torch.distributed world."""

    def __init__(
        self,
        model_path: str | Path,
        cfg: TrainerConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        local_rank: Optional[int] = None,
    ) -> None:
        require_megatron()
        import torch.distributed as dist
        from mbridge import AutoBridge
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.utils import get_model_config

        self.cfg = cfg
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
        self.bridge = AutoBridge.from_pretrained(str(model_path), dtype=dtype)
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
        config = get_model_config(self.model[0])
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        self.policy_version = 0
        self.gap = GapMeter()  # engine-trainer log-prob gap of each step (rayrl/rl/logprob_gap.py)

    # -- training ----------------------------------------------------------------------------------

    def _forward_step(self, data_iterator: Iterator[PackedBatch], model: Any) -> tuple[torch.Tensor, Any]:
        from megatron.core.packed_seq_params import PackedSeqParams

        batch: PackedBatch = next(data_iterator)
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=batch.cu_seqlens,
            cu_seqlens_kv=batch.cu_seqlens,
            max_seqlen_q=batch.max_seqlen,
            max_seqlen_kv=batch.max_seqlen,
        )
        output = model(
            input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=None, packed_seq_params=packed
        )
        return output, lambda logits: self._loss(batch, logits)

    def _loss(self, batch: PackedBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logp_all = -vocab_parallel_cross_entropy(logits.float().contiguous(), batch.targets)
        keep = batch.loss_mask.bool()
        logp = logp_all[keep]  # only trained positions: padding and context never enter exp()
        rollout = batch.rollout_logprobs[keep]
        out = ppo_clip_token_loss(
            logp,
            rollout,
            batch.advantages[keep],
            torch.ones_like(logp),
            clip_eps=self.cfg.clip_eps,
            clip_eps_high=self.cfg.clip_eps_high,
            tis_cap=self.cfg.tis_cap or 0.0,
            kl_coef=self.cfg.kl_coef,
        )
        self.gap.add(logp, rollout, batch.policy_versions[keep] == self.policy_version)
        num_tokens = out.tokens.detach().to(torch.int)
        stats = torch.stack([
            out.loss.detach(), out.clip_fraction, out.approx_kl, out.tis_weight, out.tokens,
            (logp.detach() - rollout).abs().sum(),
        ]).float()  # fmt: skip
        return out.loss, num_tokens, {"stats": stats}

    def train_step(
        self, samples: list[Sample], advantages: Sequence[float], global_tokens: Optional[int] = None
    ) -> dict[str, Any]:
        """One optimizer step on this rank's data-parallel shard (``samples``: every rank of one replica
        gets the same samples in the same order, rayrl/rl/shard.py).

        ``global_tokens`` is accepted for TrainerGroup's call shape; Megatron counts the tokens itself.
        """
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import get_forward_backward_func

        started = time.monotonic()
        keep = [i for i, s in enumerate(samples) if s.num_trained_tokens > 0 and advantages[i] != 0.0]
        kept = [samples[i] for i in keep]
        adv = [float(advantages[i]) for i in keep]
        if self.cfg.sequence_packing:  # several samples per micro-batch, packed back to back
            groups = micro_batches_by_tokens([len(s.tokens) for s in kept], self.cfg.micro_batch_tokens)
        else:  # one sample per micro-batch
            groups = [[i] for i in range(len(kept))]
        device = torch.device("cuda", torch.cuda.current_device())
        cp_size, cp_rank = self.mpu.get_context_parallel_world_size(), self.mpu.get_context_parallel_rank()
        batches = [
            split_for_context_parallel(
                pack_samples([kept[i] for i in g], [adv[i] for i in g], self.align).to(device), cp_size, cp_rank
            )
            for g in groups
        ] or [empty_batch(self.align).to(device)]
        # pipeline stages of one replica must agree on the number of micro-batches: they hold the same shard
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iter(batches),
            model=self.model,
            num_microbatches=len(batches),
            seq_length=max(b.tokens.shape[1] for b in batches),
            micro_batch_size=1,
            forward_only=False,
        )
        update_ok, grad_norm, _ = self.optimizer.step()
        self.policy_version += 1
        # loss statistics live on the last pipeline stage: sum them over data-parallel ranks, then share
        stats = torch.zeros(6, device=device)
        if self.mpu.is_pipeline_last_stage(ignore_virtual=True):
            for item in reduced:
                stats += item["stats"]
            dist.all_reduce(stats, group=self.mpu.get_data_parallel_group(with_context_parallel=True))
        if self.mpu.get_pipeline_model_parallel_world_size() > 1:
            last = self.mpu.get_pipeline_model_parallel_last_rank()
            dist.broadcast(stats, src=last, group=self.mpu.get_pipeline_model_parallel_group())
        loss, clip, kl, tis, tokens, abs_diff = stats.tolist()  # summed over every data-parallel replica
        n = max(tokens, 1.0)
        return {
            "loss": loss / n,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "update_successful": bool(update_ok),
            "clip_fraction": clip / n,
            "approx_kl": kl / n,
            "tis_weight_mean": tis / n,
            "logprob_abs_diff": abs_diff / n,
            "trained_tokens": sum(int(s.loss_mask.sum()) for s in kept),  # this replica's: summed per replica
            "trained_samples": len(kept),
            "micro_batches": len(batches),
            "train_time_s": time.monotonic() - started,
            "policy_version": self.policy_version,
            **self.gap.stats(device=device),
        }

    @torch.no_grad()
    def token_logprobs(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """Log-probs of each sample's response tokens (every response token, trained or not), on a
        single model-parallel group without PP (tests compare them with the HF model and the engines)."""
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        if self.mpu.get_pipeline_model_parallel_world_size() > 1 or self.mpu.get_context_parallel_world_size() > 1:
            raise NotImplementedError("token_logprobs runs without pipeline or context parallelism")
        device = torch.device("cuda", torch.cuda.current_device())
        full = [Sample(tokens=s.tokens, prompt_length=s.prompt_length,
                       loss_mask=np.ones(len(s.tokens) - s.prompt_length, np.int8),
                       rollout_logprobs=np.zeros(len(s.tokens) - s.prompt_length, np.float32),
                       policy_versions=np.zeros(len(s.tokens) - s.prompt_length, np.int32)) for s in samples]  # fmt: skip
        batch = pack_samples(full, [1.0] * len(full), self.align).to(device)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch.cu_seqlens, cu_seqlens_kv=batch.cu_seqlens,
                                 max_seqlen_q=batch.max_seqlen, max_seqlen_kv=batch.max_seqlen)  # fmt: skip
        for m in self.model:
            m.eval()
        logits = self.model[0](input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=None,
                               packed_seq_params=packed)  # fmt: skip
        logp = -vocab_parallel_cross_entropy(logits.float().contiguous(), batch.targets)[0]
        keep = batch.loss_mask[0].bool()
        flat = logp[keep].cpu().numpy()
        out, start = [], 0
        for s in full:
            n = len(s.tokens) - s.prompt_length
            out.append(flat[start : start + n])
            start += n
        return out

    # -- weights for the engines -------------------------------------------------------------------

    def named_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors (gathered over TP/PP), on the GPU. EVERY rank must iterate this to the end."""
        for name, tensor in self.bridge.export_weights(self.model):
            yield name, (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor)

    def save_hf(self, directory: str | Path) -> None:
        """A HF safetensors checkpoint (rank 0 writes; every rank takes part)."""
        self.bridge.save_weights(self.model, str(directory))

    # -- checkpoints ---------------------------------------------------------------------------------

    def _sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        """Model and optimizer as Megatron distributed-checkpoint state. ``is_loading``: the distributed
        optimizer builds its state's layout for a load (it differs from a save's)."""
        model_sd = {f"model{i}": _unwrap_for_sharding(m).sharded_state_dict() for i, m in enumerate(self.model)}
        state: dict[str, Any] = dict(model_sd)
        merged = {}
        for sd in model_sd.values():
            merged.update(sd)
        state["optimizer"] = self.optimizer.sharded_state_dict(merged, is_loading=is_loading)
        return state

    def save_checkpoint(self, directory: str | Path) -> None:
        """Megatron distributed checkpoint (model + optimizer, resharding-capable) and this rank's RNG
        and policy version."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        (directory / "megatron").mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(self._sharded_state_dict(), str(directory / "megatron"))
        extra = {
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
        }
        torch.save(extra, directory / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            (directory / "trainer_state.json").write_text(json.dumps({"policy_version": self.policy_version}))
        dist.barrier()

    def load_checkpoint(self, directory: str | Path) -> None:
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        loaded = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), str(directory / "megatron"))
        for i, m in enumerate(self.model):
            _unwrap_for_sharding(m).load_state_dict(loaded[f"model{i}"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.memory.adopt_optimizer_state(self.optimizer)  # loaded state that landed outside the region
        self.policy_version = int(json.loads((directory / "trainer_state.json").read_text())["policy_version"])
        rng_file = directory / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            extra = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(extra["torch_rng"])
            torch.cuda.set_rng_state(extra["cuda_rng"])
            np.random.set_state(extra["numpy_rng"])
            random.setstate(extra["python_rng"])

    # -- colocation --------------------------------------------------------------------------------

    def offload(self) -> bool:
        """Release parameters, gradients and optimizer state (contents kept in pinned host memory) so
        engines get the GPU; False when a no-op (``trainer.memory_saver`` off)."""
        return self.memory.pause()

    def onload(self) -> bool:
        """Map them back, contents restored bit for bit."""
        return self.memory.resume()
