"""The Megatron backend's data layout and its loss, in plain torch (tested on CPU).

A micro-batch is its samples packed into one sequence (batch dimension 1, Megatron's THD format: no
padding between samples). Position ``p`` of a sample predicts its token ``p + 1``: ``targets[p]`` is
that token and ``loss_mask[p]`` is 1 where it is a trained response token. The loss helper's
per-token inputs (rayrl/rl/objective.py ``Objective.token_fields``: rollout log-probs,
advantages, aggregation weights, ...) sit at those positions in ``fields``, so cutting the sequence for
context parallelism keeps every input beside its token.

:func:`packed_loss` is what the Megatron trainer's loss function returns for a micro-batch, from the
log-probs Megatron computed at every position: the trained tokens go through the same
:class:`~rayrl.rl.objective.Objective` as the torch backend's, so both backends give the same
loss on the same batch (tests/trainers/test_megatron_packing.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from rayrl.rl.objective import FIELDS, STATS, Objective, TokenBatch
from rayrl.types import Sample

FIELD_DTYPES = {"seq_index": torch.long}  # the others are float32


@dataclass
class PackedBatch:
    """Samples packed into one sequence (module docstring), every per-position tensor [1, T] aligned.
    Each sample is padded to a multiple of ``align`` (tensor/context parallel split sizes).
    ``proximal`` / ``ref_logp``: log-probs of this rank's trained tokens (in position order) from the
    no-grad passes before the step's first update, when the objective needs them."""

    tokens: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 for each sample
    targets: torch.Tensor  # [1, T] int64
    loss_mask: torch.Tensor  # [1, T] float32
    cu_seqlens: torch.Tensor  # [n + 1] int32, padded segment boundaries
    max_seqlen: int
    num_seqs: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [1, T]
    proximal: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None

    def to(self, device: torch.device) -> PackedBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return PackedBatch(move(self.tokens), move(self.position_ids), move(self.targets), move(self.loss_mask),
                           move(self.cu_seqlens), self.max_seqlen, self.num_seqs,
                           {k: move(v) for k, v in self.fields.items()})

    def token_batch(self) -> TokenBatch:
        """The loss helper's inputs for this rank's trained tokens, in position order."""
        keep = self.loss_mask[0].bool()
        picked = {name: self.fields[name][0, keep] for name in FIELDS}
        return TokenBatch(**picked, num_seqs=self.num_seqs, proximal=self.proximal, ref_logp=self.ref_logp)


def pack_samples(samples: Sequence[Sample], token_fields: Optional[dict[str, np.ndarray]] = None,
                 align: int = 1) -> PackedBatch:
    """One packed sequence from ``samples``; ``token_fields`` (per trained token, sample order, as
    ``Objective.token_fields`` gives them) are placed at their tokens' positions."""
    if not samples:
        raise ValueError("pack_samples needs at least one sample")
    seg_lengths = [int(math.ceil(len(s.tokens) / align) * align) for s in samples]
    total = sum(seg_lengths)
    tokens = torch.zeros(total, dtype=torch.long)
    positions = torch.zeros(total, dtype=torch.long)
    targets = torch.zeros(total, dtype=torch.long)
    mask = torch.zeros(total, dtype=torch.float32)
    where_all = []
    start = 0
    for s, seg in zip(samples, seg_lengths):
        ids = torch.from_numpy(np.asarray(s.tokens, dtype=np.int64))
        n = len(ids)
        tokens[start : start + n] = ids
        positions[start : start + seg] = torch.arange(seg)
        targets[start : start + n - 1] = ids[1:]
        trained = np.nonzero(np.asarray(s.loss_mask))[0]
        where_all.append(start + s.prompt_length + trained - 1)  # the position that predicts response token j
        start += seg
    where = torch.from_numpy(np.concatenate(where_all).astype(np.int64))
    mask[where] = 1.0
    fields = {}
    for name, values in (token_fields or {}).items():
        placed = torch.zeros(total, dtype=FIELD_DTYPES.get(name, torch.float32))
        placed[where] = torch.from_numpy(np.asarray(values)).to(placed.dtype)
        fields[name] = placed[None]
    cu = torch.tensor([0, *np.cumsum(seg_lengths)], dtype=torch.int32)
    return PackedBatch(tokens[None], positions[None], targets[None], mask[None], cu, max(seg_lengths),
                       len(samples), fields)


def empty_batch(align: int) -> PackedBatch:
    """A batch that trains nothing: a rank whose data-parallel shard is empty still joins the collectives."""
    z = torch.zeros((1, align), dtype=torch.long)
    f = torch.zeros((1, align), dtype=torch.float32)
    fields = {name: torch.zeros((1, align), dtype=FIELD_DTYPES.get(name, torch.float32)) for name in FIELDS}
    return PackedBatch(z, torch.arange(align)[None], z.clone(), f, torch.tensor([0, align], dtype=torch.int32),
                       align, 1, fields)


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

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(1, index)

    return PackedBatch(pick(batch.tokens), pick(batch.position_ids), pick(batch.targets), pick(batch.loss_mask),
                       batch.cu_seqlens, batch.max_seqlen, batch.num_seqs,
                       {k: pick(v) for k, v in batch.fields.items()})


def packed_loss(
    objective: Objective,
    batch: PackedBatch,
    logp_all: torch.Tensor,
    global_tokens: int,
    entropy_all: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """What a Megatron loss function returns for one micro-batch: ``(loss, num_tokens, {"stats": ...})``.

    ``logp_all`` / ``entropy_all`` [1, T]: the log-prob of each position's target and the entropy there.
    With ``calculate_per_token_loss`` Megatron sums every rank's and micro-batch's gradients and divides
    them by the summed ``num_tokens`` (this rank's trained tokens here), i.e. by ``global_tokens``, the
    mini-batch's trained tokens over all ranks. The objective's loss already carries its own global
    normalisation (the aggregation weights), so it is returned times ``global_tokens``: Megatron's
    division gives it back exactly, whatever ``algorithm.loss_agg`` is.
    """
    keep = batch.loss_mask[0].bool()
    logp = logp_all[0, keep]
    entropy = entropy_all[0, keep] if entropy_all is not None else None
    loss, stats = objective.loss(batch.token_batch(), logp, entropy)
    stacked = torch.stack([stats[name] for name in STATS]).float()
    return loss * float(global_tokens), keep.sum().to(torch.int), {"stats": stacked}


ReduceFn = Callable[[torch.Tensor], torch.Tensor]


def sharded_entropy(logits: torch.Tensor, sum_over_shards: ReduceFn, max_over_shards: ReduceFn) -> torch.Tensor:
    """Entropy per position of a softmax whose vocabulary is split over tensor-parallel ranks, each
    holding ``logits`` [..., V/tp]: ``m + log(S) - Z / S`` with ``m`` the global max (a constant: the
    entropy does not depend on it), ``S = sum exp(z - m)`` and ``Z = sum exp(z - m) z``, both summed over
    the shards in one call of ``sum_over_shards`` (stacked on a new first axis; an all-reduce whose
    backward passes the gradient through, Megatron's ``reduce_from_tensor_model_parallel_region``)."""
    z = logits.float()
    m = max_over_shards(z.detach().max(dim=-1, keepdim=True).values)
    e = torch.exp(z - m)
    s, zsum = sum_over_shards(torch.stack([e.sum(-1), (e * z).sum(-1)]))
    return m.squeeze(-1) + torch.log(s) - zsum / s
