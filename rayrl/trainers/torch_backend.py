"""The torch trainer backend: a transformers causal LM trained with RL on CPU or one GPU per rank.

One ``train_step`` trains one rollout batch: its :class:`~rayrl.rl.updates.UpdatePlan` (mini-batches,
epochs) makes one or more optimizer steps; each mini-batch's samples are packed into micro-batches of
at most ``micro_batch_tokens`` (padded) tokens, each micro-batch's loss comes from the one loss helper
(:class:`~rayrl.rl.objective.Objective`, which carries the aggregation's global normalisers),
gradients are all-reduced across ranks, clipped, and AdamW steps at the learning rate of the schedule
(rayrl/trainers/lr_schedule.py). With a KL to a reference model, a frozen copy of the reference is
held beside the policy, inside the same memory-saver region, so it leaves the device with the rest
when the trainer offloads. With ``trainer.lora`` the policy is the base model plus PEFT's LoRA adapter
(rayrl/trainers/lora.py): only the adapter trains, the reference is the same model with the adapter
switched off (no copy), checkpoints hold the adapter and its optimizer state, and the engines get the
adapter alone. Logits are computed only at trained positions, which saves most of the LM-head cost and
memory for tool-heavy episodes. The tokens every sample of a micro-batch starts with (the system prompt,
tool schemas and few-shot turns all episodes share; a GRPO group's whole prompt) are run once and their
keys/values joined to each sample's own (``trainer.share_prefix``; a read-only cache,
rayrl/trainers/prefix_cache.py): the gradient is the same, since autograd sums what each sample sends back
through the shared prefix, and the compute of the prefix is paid once. ``trainer.gradient_checkpointing``
recomputes each decoder layer in the backward pass (prefix_cache.py's own checkpointing, which keeps the
shared prefix).

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

from rayrl.config import AlgorithmConfig, TrainerConfig
from rayrl.machine import compute_dtype as resolve_compute_dtype
from rayrl.machine import cpu_has_native_bf16
from rayrl.rl.objective import Objective, TokenBatch, loss_metrics
from rayrl.rl.policy_losses import entropy_from_logits
from rayrl.rl.updates import MiniBatch, UpdatePlan, plan_updates
from rayrl.trainers import lora, prefix_cache
from rayrl.trainers.head_logprobs import frozen_head_logprobs, head_is_frozen
from rayrl.trainers.lr_schedule import lr_at, set_lr
from rayrl.trainers.memory_saver import MemorySaver, init_optimizer_state
from rayrl.types import Sample
from rayrl.weights.files import export_state_dict

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
    where it is faster than float32: docs/results/design_figures.md) and float32 elsewhere, where
    emulated bf16 would be slower. Master weights, gradients and the optimizer stay in ``trainer.dtype``.
    """
    native = device.type == "cpu" and cpu_has_native_bf16()
    concrete = resolve_compute_dtype(compute_dtype, device.type == "cuda", native)
    return torch.bfloat16 if concrete == "bfloat16" else None


class TorchTrainer:
    """RL training of a transformers model; one instance per rank."""

    def __init__(
        self,
        model_path: str | Path,
        cfg: TrainerConfig,
        *,
        algorithm: AlgorithmConfig | None = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        device: str | None = None,
        memory: MemorySaver | None = None,
    ) -> None:
        """``algorithm``: what the loss is (default: GRPO's PPO-clip); ``memory``: the saver holding the
        trainer's GPU state (default: one from ``cfg.memory_saver``)."""
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.algorithm = algorithm if algorithm is not None else AlgorithmConfig()
        self.objective = Objective(self.algorithm)
        self.rank = rank
        self.world_size = world_size
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.autocast_dtype = autocast_dtype(cfg.compute_dtype, self.device)
        torch.manual_seed(seed + rank)
        random.seed(seed + rank)
        np.random.seed(seed + rank)
        if memory is None and cfg.memory_saver_standin and self.device.type == "cpu":
            from rayrl.trainers.memory_standin import UnmappedStandIn

            memory = UnmappedStandIn(lambda: (self.model, self.reference), lambda: self.optimizer)
        self.memory = memory if memory is not None else MemorySaver(cfg.memory_saver, device=self.device)
        with self.memory.region():  # parameters (and buffers) land on the device inside the region
            model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=_DTYPES[cfg.dtype])
            model = model.to(self.device)
            model.config.use_cache = False
            if cfg.gradient_checkpointing:  # ours, not transformers': it keeps the shared prefix
                prefix_cache.checkpoint_layers(model)
            self.prefix_read_only = prefix_cache.prefix_read_only_fits(model.config)
            self.lora = cfg.lora.enabled
            self.model = lora.wrap_with_lora(model, cfg.lora) if self.lora else model
            if self.lora and self.autocast_dtype is not None:
                lora.leave_input_dtype_to_autocast(self.model)
            # a LoRA policy's reference is its own base with the adapter off, unless another model is named
            own_base = self.lora and self.algorithm.reference_path is None
            needs_copy = self.objective.uses_reference and not own_base
            self.reference = self._load_reference(model_path) if needs_copy else None
            self.reference_is_base = self.objective.uses_reference and own_base
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr, betas=tuple(cfg.betas),
            weight_decay=cfg.weight_decay,
        )
        if self.memory.active:  # everything offload must free exists now, inside the region
            with self.memory.region():
                for p in self.model.parameters():
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
                init_optimizer_state(self.optimizer)
        self.policy_version = 0
        self.optimizer_steps = 0  # over the whole run: where the learning-rate schedule is

    def _load_reference(self, model_path: str | Path) -> torch.nn.Module:
        """The frozen reference policy (``algorithm.reference_path``, default the initial weights)."""
        from transformers import AutoModelForCausalLM

        from rayrl.models import resolve_model_path

        path = self.algorithm.reference_path
        source = str(model_path) if path is None else str(resolve_model_path(path))
        ref = AutoModelForCausalLM.from_pretrained(source, dtype=_DTYPES[self.cfg.dtype]).to(self.device)
        ref.config.use_cache = False
        ref.eval()
        ref.requires_grad_(False)
        return ref

    # -- training ----------------------------------------------------------------------------------

    def _micro_batch(self, samples: list[Sample], advantages: Sequence[float | np.ndarray],
                     mb: MiniBatch | None = None) -> dict[str, Any]:
        """Model inputs of ``samples`` (padded), the trained positions, and their :class:`TokenBatch`
        (``mb``: the mini-batch they belong to, whose global sizes the aggregation needs; default: just
        these samples)."""
        mb = mb or UpdatePlan.single(samples).minibatches[0]
        # a checkpointed layer runs twice: only a read-only prefix cache gives it the same keys both times
        share = self.cfg.share_prefix and (self.prefix_read_only or not self.cfg.gradient_checkpointing)
        prefix = shared_prefix_length(samples) if share else 0
        longest = max(len(s.tokens) for s in samples)
        n = len(samples)
        input_ids = torch.zeros((n, longest), dtype=torch.long)
        attention = torch.zeros((n, longest), dtype=torch.long)
        rows, cols = [], []
        for i, s in enumerate(samples):
            input_ids[i, : len(s.tokens)] = torch.from_numpy(s.tokens.astype(np.int64))
            attention[i, : len(s.tokens)] = 1
            trained = np.nonzero(s.loss_mask)[0]
            # the token at response position j sits at tokens[prompt_length + j] and is predicted
            # by the hidden state one position earlier
            rows.append(np.full(len(trained), i))
            cols.append(s.prompt_length + trained - 1)
        rows_t = torch.from_numpy(np.concatenate(rows).astype(np.int64))
        cols_t = torch.from_numpy(np.concatenate(cols).astype(np.int64))
        fields = self.objective.token_fields(samples, advantages, mb)
        return {
            "input_ids": input_ids.to(self.device),
            "attention_mask": attention.to(self.device),
            "rows": rows_t.to(self.device),
            "cols": cols_t.to(self.device),
            "targets": input_ids[rows_t, cols_t + 1].to(self.device),
            "prefix": torch.tensor(prefix),
            "tokens": TokenBatch.from_fields(fields, n, self.device),
        }

    def token_logprobs(self, batch: dict[str, Any], model: torch.nn.Module | None = None,
                       with_entropy: bool = False) -> Any:
        """Log-probs of the target tokens at the selected positions only (of ``model``, default the
        policy); with ``with_entropy``, also the entropy of the distribution at each of them."""
        model = lora.causal_lm(model if model is not None else self.model)
        head = model.get_output_embeddings()
        frozen = head_is_frozen(head)  # LoRA's tied head, no-grad passes: no logits matrix is kept
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            hidden = self._hidden_states(model, batch, self.prefix_read_only)
            selected = hidden[batch["rows"], batch["cols"] - int(batch["prefix"])]
            logits = None if frozen else head(selected).float()  # a head that trains needs them for its gradient
        if logits is None:
            logp, entropy = frozen_head_logprobs(selected, head, batch["targets"], with_entropy=with_entropy,
                                                 compute_dtype=self.autocast_dtype)
            return (logp, entropy) if with_entropy else logp
        logp = torch.log_softmax(logits, dim=-1).gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
        return (logp, entropy_from_logits(logits)) if with_entropy else logp

    @staticmethod
    def _hidden_states(model: torch.nn.Module, batch: dict[str, Any], read_only: bool = True) -> torch.Tensor:
        """Last hidden states from position ``batch["prefix"]`` on; the shared prefix runs once, and its keys and
        values reach the rest as a read-only cache (rayrl/trainers/prefix_cache.py; transformers' own, grown per
        layer, where the model's layers need it: ``read_only`` False). ``model``: a transformers causal LM (its
        LoRA layers, if any, live inside it)."""
        ids, mask, prefix = batch["input_ids"], batch["attention_mask"], int(batch["prefix"])
        base = model.base_model
        if prefix == 0:
            return base(input_ids=ids, attention_mask=mask).last_hidden_state
        cache = base(input_ids=ids[:1, :prefix], use_cache=True).past_key_values
        shared = prefix_cache.read_only_prefix(cache) if read_only else None
        if shared is None:
            cache.batch_repeat_interleave(ids.shape[0])
            shared = cache
        return base(input_ids=ids[:, prefix:], attention_mask=mask, past_key_values=shared,
                    use_cache=True).last_hidden_state

    def train_step(
        self, samples: list[Sample], advantages: Sequence[float | np.ndarray], plan: UpdatePlan | None = None
    ) -> dict[str, Any]:
        """Train one rollout batch: ``plan`` (from TrainerGroup: this rank's mini-batches with the global
        sizes) says which of ``samples`` each optimizer step trains; without one, the samples that train
        (rayrl/rl/updates.py) go in one mini-batch counted on this rank alone. ``advantages``: one float
        per sample, or an array over its response tokens."""
        started = time.monotonic()
        if plan is None:
            (keep, plan), = plan_updates(samples, advantages, self.algorithm)
            samples, advantages = [samples[i] for i in keep], [advantages[i] for i in keep]
        objective = self.objective
        objective.begin_step(self.policy_version)
        steps = [self._mini_batch(samples, advantages, mb) for mb in plan.minibatches]
        self._no_grad_passes([b for step in steps for b in step], objective.needs_prepass(plan))
        sums: dict[str, float] = {}
        grad_norms, lr = [], self.cfg.lr
        self._zero_grad()
        for _ in range(plan.epochs):
            for step in steps:
                for batch in step:
                    if objective.uses_entropy:
                        logp, entropy = self.token_logprobs(batch, with_entropy=True)
                    else:
                        logp, entropy = self.token_logprobs(batch), None
                    loss, stats = objective.loss(batch["tokens"], logp, entropy)
                    loss.backward()
                    for key, value in stats.items():
                        sums[key] = sums.get(key, 0.0) + float(value)
                lr = lr_at(self.optimizer_steps, self.cfg)
                set_lr(self.optimizer, lr)
                grad_norms.append(self._reduce_and_step())
                self.optimizer_steps += 1
                objective.close_first_forward()
        self.policy_version += 1
        return {
            **loss_metrics(sums, plan.optimizer_steps),
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "lr": lr,
            "optimizer_steps": plan.optimizer_steps,
            "trained_tokens": sum(s.num_trained_tokens for s in samples),
            "trained_samples": len(samples),
            "train_time_s": time.monotonic() - started,
            "policy_version": self.policy_version,
            **objective.gap_stats(device=self.device),
        }

    def _mini_batch(self, samples: list[Sample], advantages: Sequence[float | np.ndarray],
                    mb: MiniBatch) -> list[dict[str, Any]]:
        """The micro-batches of one mini-batch (fixed for the step: epochs reuse them)."""
        chosen = [samples[i] for i in mb.indices]
        adv = [advantages[i] for i in mb.indices]
        groups = pack_micro_batches([len(s.tokens) for s in chosen], self.cfg.micro_batch_tokens) if chosen else []
        return [self._micro_batch([chosen[i] for i in g], [adv[i] for i in g], mb) for g in groups]

    @torch.no_grad()
    def _no_grad_passes(self, batches: list[dict[str, Any]], proximal: bool) -> None:
        """Before any update: the reference model's log-probs (a KL is on) and, with several optimizer
        steps, the policy's own (the proximal log-probs, the step's first forward), for every micro-batch."""
        for batch in batches:
            tokens: TokenBatch = batch["tokens"]
            if self.reference is not None:
                tokens.ref_logp = self.token_logprobs(batch, self.reference)
            elif self.reference_is_base:
                with lora.adapter_off(self.model):
                    tokens.ref_logp = self.token_logprobs(batch)
            if proximal:
                tokens.proximal = self.token_logprobs(batch)
                self.objective.record(tokens.proximal, tokens)
        if proximal:
            self.objective.close_first_forward()

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
        """What the engines need: the HF-named weights (tied weights once), or with LoRA the adapter alone
        (PEFT's names; :meth:`adapter_config` says what it is)."""
        state = lora.adapter_tensors(self.model, dtype) if self.lora else export_state_dict(self.model, dtype)
        yield from state.items()

    def adapter_config(self) -> dict[str, Any]:
        """The LoRA adapter's adapter_config.json, as the engines' LoRA route takes it."""
        if not self.lora:
            raise ValueError("adapter_config: trainer.lora is off; there is no adapter")
        return lora.adapter_config(self.model)

    def export_adapter(self, directory: str | Path) -> Path:
        """The LoRA adapter in PEFT's own format (``PeftModel.from_pretrained`` loads it)."""
        if not self.lora:
            raise ValueError("export_adapter: trainer.lora is off; there is no adapter")
        return lora.export_adapter(self.model, directory)

    def export_merged(self, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
        """A plain HF model: the policy's weights (with LoRA, the adapter merged in)."""
        if self.lora:
            return lora.export_merged(self.model, directory, dtype)
        directory = Path(directory)
        self.model.save_pretrained(str(directory), state_dict=export_state_dict(self.model, dtype))
        return directory

    def save_checkpoint(self, directory: str | Path, as_rank: int | None = None) -> None:
        """``rank<r>.pt``: the optimizer, policy version and RNG states, and on rank 0 the model (with LoRA,
        the adapter alone: the frozen base comes back from the model path).
        ``as_rank=0`` writes rank 0's file (model included) from any rank: every rank holds the full state
        (data parallel), so a surviving rank can write the whole checkpoint after rank 0 died."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        rank = self.rank if as_rank is None else as_rank
        state = {
            "optimizer": self.optimizer.state_dict(),
            "policy_version": self.policy_version,
            "optimizer_steps": self.optimizer_steps,
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
        }
        if rank == 0:
            state["model"] = lora.trainable_state(self.model) if self.lora else self.model.state_dict()
            state["lora_rank"] = self.cfg.lora.rank
        tmp = directory / f".rank{rank}.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(directory / f"rank{rank}.pt")

    def load_checkpoint(self, directory: str | Path) -> None:
        directory = Path(directory)
        own = directory / f"rank{self.rank}.pt"
        # after a rank failure one surviving rank saves rank0.pt: its optimizer state is every replica's
        mine = torch.load(own if own.exists() else directory / "rank0.pt", weights_only=False)
        whole = mine if "model" in mine else torch.load(directory / "rank0.pt", weights_only=False)
        saved_rank = int(whole.get("lora_rank", 0))
        if saved_rank != self.cfg.lora.rank:
            raise ValueError(f"trainer.lora.rank: the checkpoint in {directory} was written with "
                             f"{saved_rank} (0: full weights), this run has {self.cfg.lora.rank}")
        if self.lora:
            lora.load_trainable_state(self.model, whole["model"])
        else:
            self.model.load_state_dict(whole["model"])
        self.optimizer.load_state_dict(mine["optimizer"])
        self.memory.adopt_optimizer_state(self.optimizer)  # load_state_dict made new tensors, outside it
        self.policy_version = int(mine["policy_version"])
        # older checkpoints: one optimizer step per version
        self.optimizer_steps = int(mine.get("optimizer_steps", self.policy_version))
        torch.set_rng_state(mine["torch_rng"])
        np.random.set_state(mine["numpy_rng"])
        random.setstate(mine["python_rng"])
