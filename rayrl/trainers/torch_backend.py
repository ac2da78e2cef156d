"""The torch trainer backend: a transformers causal LM trained with GRPO/PPO on CPU or one GPU per rank.

One ``train_step`` is one optimizer step over a rollout batch: samples are packed into micro-batches
of at most ``micro_batch_tokens`` (padded) tokens, each micro-batch's summed token loss is divided by
the global number of trained tokens (all ranks), gradients are all-reduced across ranks, clipped, and
AdamW steps. Logits are computed only at trained positions, which saves most of the LM-head cost and
memory for tool-heavy episodes. The tokens every sample of a micro-batch starts with (the system prompt,
tool schemas and few-shot turns all episodes share; a GRPO group's whole prompt) are run once and their
keys/values repeated for each sample (``trainer.share_prefix``): the gradient is the same, since autograd
sums what each sample sends back through the shared prefix, and the compute of the prefix is paid once.

Colocated on a GPU (``trainer.memory_saver``), parameters, gradients and AdamW's moments are all
allocated inside the :class:`~rayrl.trainers.memory_saver.MemorySaver` region when the trainer is made:
gradients stay allocated (zeroed in place instead of freed) and the optimizer state is created eagerly
(``init_optimizer_state``), because AdamW would otherwise create its moments lazily at the first step,
outside the region, where ``offload`` could not free them. ``offload``/``onload`` pause and resume
that region; on CPU they do nothing.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rayrl.config import TrainerConfig
from rayrl.config.resolve import compute_dtype as resolve_compute_dtype
from rayrl.config.resolve import cpu_has_native_bf16
from rayrl.trainers.losses import ppo_clip_token_loss
from rayrl.trainers.memory_saver import MemorySaver, init_optimizer_state
from rayrl.weights.files import export_state_dict
from rayrl.types import Sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pack_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices so that (count × longest) per group stays within ``max_tokens``.

    Sorting by length keeps padding low; a sample longer than ``max_tokens`` gets a group of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and new_longest * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        groups.append(current)
    return groups


MIN_SHARED_PREFIX = 16  # a shorter common prefix is not worth a second forward call


def shared_prefix_length(samples: Sequence[Sample]) -> int:
    """Tokens all ``samples`` start with that no trained position needs the logits of.

    The shared part ends before the first position whose hidden state predicts a trained token, and
    leaves every sample at least one token of its own.
    """
    if len(samples) < 2:
        return 0
    limit = min(len(s.tokens) - 1 for s in samples)
    for s in samples:
        trained = np.nonzero(s.loss_mask)[0]
        if len(trained):
            limit = min(limit, s.prompt_length + int(trained[0]) - 1)
    first = samples[0].tokens[:limit]
    for s in samples[1:]:
        differs = np.nonzero(s.tokens[:limit] != first)[0]
        limit = int(differs[0]) if len(differs) else limit
        first = first[:limit]
    return limit if limit >= MIN_SHARED_PREFIX else 0


def autocast_dtype(compute_dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``trainer.compute_dtype`` on ``device`` (None: plain float32).

    "auto" picks bfloat16 where the hardware computes it natively (CUDA; a CPU with AVX512-BF16 or AMX,
    where a SmolLM2-135M step runs about 2.5x faster than in float32) and float32 elsewhere, where
    emulated bf16 would be slower. Master weights, gradients and the optimizer stay in ``trainer.dtype``.
    """
    native = device.type == "cpu" and cpu_has_native_bf16()
    concrete = resolve_compute_dtype(compute_dtype, device.type == "cuda", native)
    return torch.bfloat16 if concrete == "bfloat16" else None


def token_staleness(samples: Sequence[Sample], current_version: int) -> np.ndarray:
    """Per trained token: how many policy versions behind the weights being trained it was generated
    (``current_version - policy_versions``); what the importance correction makes up for."""
    parts = [current_version - s.policy_versions[s.loss_mask.astype(bool)] for s in samples]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


class TorchTrainer:
    """GRPO/PPO training of a transformers model; one instance per rank."""

    def __init__(
        self,
        model_path: str | Path,
        cfg: TrainerConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        device: str | None = None,
        memory: MemorySaver | None = None,
    ) -> None:
        """``memory``: the saver holding the trainer's GPU state (default: one from ``cfg.memory_saver``)."""
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.autocast_dtype = autocast_dtype(cfg.compute_dtype, self.device)
        torch.manual_seed(seed + rank)
        random.seed(seed + rank)
        np.random.seed(seed + rank)
        self.memory = memory if memory is not None else MemorySaver(cfg.memory_saver, device=self.device)
        with self.memory.region():  # parameters (and buffers) land on the device inside the region
            model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=_DTYPES[cfg.dtype])
            self.model = model.to(self.device)
        self.model.config.use_cache = False
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )
        if self.memory.active:  # everything offload must free exists now, inside the region
            with self.memory.region():
                for p in self.model.parameters():
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
                init_optimizer_state(self.optimizer)
        self.policy_version = 0

    # -- training ----------------------------------------------------------------------------------

    def _micro_batch(self, samples: list[Sample], advantages: list[float]) -> dict[str, torch.Tensor]:
        # transformers drops the cache under gradient checkpointing: no shared prefix there
        share = self.cfg.share_prefix and not self.cfg.gradient_checkpointing
        prefix = shared_prefix_length(samples) if share else 0
        longest = max(len(s.tokens) for s in samples)
        n = len(samples)
        input_ids = torch.zeros((n, longest), dtype=torch.long)
        attention = torch.zeros((n, longest), dtype=torch.long)
        rows, cols, rollout_lp, adv = [], [], [], []
        for i, (s, a) in enumerate(zip(samples, advantages)):
            input_ids[i, : len(s.tokens)] = torch.from_numpy(s.tokens.astype(np.int64))
            attention[i, : len(s.tokens)] = 1
            trained = np.nonzero(s.loss_mask)[0]
            # the token at response position j sits at tokens[prompt_length + j] and is predicted
            # by the hidden state one position earlier
            positions = s.prompt_length + trained - 1
            rows.append(np.full(len(trained), i))
            cols.append(positions)
            rollout_lp.append(s.rollout_logprobs[trained])
            adv.append(np.full(len(trained), a, dtype=np.float32))
        rows_t = torch.from_numpy(np.concatenate(rows).astype(np.int64))
        cols_t = torch.from_numpy(np.concatenate(cols).astype(np.int64))
        return {
            "input_ids": input_ids.to(self.device),
            "attention_mask": attention.to(self.device),
            "rows": rows_t.to(self.device),
            "cols": cols_t.to(self.device),
            "targets": input_ids[rows_t, cols_t + 1].to(self.device),
            "rollout_logp": torch.from_numpy(np.concatenate(rollout_lp)).to(self.device),
            "advantages": torch.from_numpy(np.concatenate(adv)).to(self.device),
            "prefix": torch.tensor(prefix),
        }

    def token_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probs of the target tokens at the selected positions only."""
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            hidden = self._hidden_states(batch)
            selected = hidden[batch["rows"], batch["cols"] - int(batch["prefix"])]
            logits = self.model.get_output_embeddings()(selected).float()
        return torch.log_softmax(logits, dim=-1).gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)

    def _hidden_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Last hidden states from position ``batch["prefix"]`` on; the shared prefix runs once."""
        ids, mask, prefix = batch["input_ids"], batch["attention_mask"], int(batch["prefix"])
        base = self.model.base_model
        if prefix == 0:
            return base(input_ids=ids, attention_mask=mask).last_hidden_state
        cache = base(input_ids=ids[:1, :prefix], use_cache=True).past_key_values
        cache.batch_repeat_interleave(ids.shape[0])
        return base(input_ids=ids[:, prefix:], attention_mask=mask, past_key_values=cache,
                    use_cache=True).last_hidden_state

    def train_step(
        self, samples: list[Sample], advantages: Sequence[float], global_tokens: int | None = None
    ) -> dict[str, Any]:
        """One optimizer step; ``global_tokens`` is the trained-token count over all ranks."""
        started = time.monotonic()
        keep = [i for i, s in enumerate(samples) if s.num_trained_tokens > 0 and advantages[i] != 0.0]
        samples = [samples[i] for i in keep]
        advantages = [float(advantages[i]) for i in keep]
        local_tokens = sum(s.num_trained_tokens for s in samples)
        total = float(global_tokens if global_tokens is not None else local_tokens)
        sums = {"loss": 0.0, "clip": 0.0, "kl": 0.0, "tis": 0.0, "tokens": 0.0, "abs_lp_diff": 0.0}
        self._zero_grad()
        for group in pack_micro_batches([len(s.tokens) for s in samples], self.cfg.micro_batch_tokens):
            batch = self._micro_batch([samples[i] for i in group], [advantages[i] for i in group])
            logp = self.token_logprobs(batch)
            out = ppo_clip_token_loss(
                logp,
                batch["rollout_logp"],
                batch["advantages"],
                torch.ones_like(logp),
                clip_eps=self.cfg.clip_eps,
                clip_eps_high=self.cfg.clip_eps_high,
                tis_cap=self.cfg.tis_cap or 0.0,
                kl_coef=self.cfg.kl_coef,
            )
            (out.loss / max(total, 1.0)).backward()
            sums["loss"] += float(out.loss.detach())
            sums["clip"] += float(out.clip_fraction)
            sums["kl"] += float(out.approx_kl)
            sums["tis"] += float(out.tis_weight)
            sums["tokens"] += float(out.tokens)
            sums["abs_lp_diff"] += float((logp.detach() - batch["rollout_logp"]).abs().sum())
        staleness = token_staleness(samples, self.policy_version)
        grad_norm = self._reduce_and_step()
        self.policy_version += 1
        tokens = max(sums["tokens"], 1.0)
        return {
            "loss": sums["loss"] / max(total, 1.0),
            "grad_norm": grad_norm,
            "clip_fraction": sums["clip"] / tokens,
            "approx_kl": sums["kl"] / tokens,
            "tis_weight_mean": sums["tis"] / tokens,
            "logprob_abs_diff": sums["abs_lp_diff"] / tokens,
            "trained_tokens": int(sums["tokens"]),
            "trained_samples": len(samples),
            "train_time_s": time.monotonic() - started,
            "policy_version": self.policy_version,
            "staleness_mean": float(staleness.mean()) if len(staleness) else 0.0,
            "staleness_max": int(staleness.max()) if len(staleness) else 0,
            "stale_token_fraction": float((staleness > 0).mean()) if len(staleness) else 0.0,
        }

    def _reduce_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world_size > 1 and dist.is_initialized():
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self._zero_grad()
        return grad_norm

    def _zero_grad(self) -> None:
        # with the memory saver the gradients keep their place in the region: zeroed, never freed
        self.optimizer.zero_grad(set_to_none=not self.memory.active)

    # -- device memory (colocated schedule) --------------------------------------------------------

    def offload(self) -> bool:
        """Release parameters, gradients and optimizer state (contents kept in pinned host memory) so
        colocated engines can use the GPU. False when nothing moves: on CPU, where the trainer and the
        engines share host memory anyway, or with ``trainer.memory_saver`` off."""
        return self.memory.pause()

    def onload(self) -> bool:
        """Map them back, contents restored bit for bit at the same addresses (False when a no-op)."""
        return self.memory.resume()

    # -- weights and checkpoints -------------------------------------------------------------------

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights for the engines (tied weights once)."""
        yield from export_state_dict(self.model, dtype).items()

    def save_checkpoint(self, directory: str | Path, as_rank: int | None = None) -> None:
        """``rank<r>.pt``: the optimizer, policy version and RNG states, and on rank 0 the model.
        ``as_rank=0`` writes rank 0's file (model included) from any rank: every rank holds the full state
        (data parallel), so a surviving rank can write the whole checkpoint after rank 0 died."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        rank = self.rank if as_rank is None else as_rank
        state = {
            "optimizer": self.optimizer.state_dict(),
            "policy_version": self.policy_version,
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
        }
        if rank == 0:
            state["model"] = self.model.state_dict()
        tmp = directory / f".rank{rank}.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(directory / f"rank{rank}.pt")

    def load_checkpoint(self, directory: str | Path) -> None:
        directory = Path(directory)
        own = directory / f"rank{self.rank}.pt"
        # after a rank failure one surviving rank saves rank0.pt: its optimizer state is every replica's
        mine = torch.load(own if own.exists() else directory / "rank0.pt", weights_only=False)
        model_state = mine.get("model") or torch.load(directory / "rank0.pt", weights_only=False)["model"]
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(mine["optimizer"])
        self.memory.adopt_optimizer_state(self.optimizer)  # load_state_dict made new tensors, outside it
        self.policy_version = int(mine["policy_version"])
        torch.set_rng_state(mine["torch_rng"])
        np.random.set_state(mine["numpy_rng"])
        random.setstate(mine["python_rng"])
