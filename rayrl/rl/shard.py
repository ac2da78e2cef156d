"""Data-parallel sharding of a training batch: which samples each trainer rank trains.

The trainer ranks form ``dp`` data-parallel replicas of ``tp * cp * pp`` ranks each (tensor, context
and pipeline parallelism; the torch backend has tp = cp = pp = 1, so every rank is its own replica).
A batch is split over the *replicas*, not over the ranks: the ranks of one replica hold different
parts of one model copy (or different parts of one sequence) and must run the same samples in the same
order, or their collectives mix different data (Megatron's ``train_step`` would also disagree on the
number of micro-batches between pipeline stages). So the driver computes :func:`rank_shards` once per
mini-batch (rayrl/rl/updates.py, for TrainerGroup) and sends every rank its replica's shards; the
backends train what they are given.

Rank order. Megatron's ``parallel_state.initialize_model_parallel`` builds its groups with a
``RankGenerator`` over ``order="tp-cp-ep-dp-pp"`` (the default in megatron-core, e.g. commit 00caa53 of
NVIDIA/Megatron-LM; the function's own docstring still says "tp-dp-pp", the signature's default is the
one used). ``generate_masked_orthogonal_rank_groups`` gives the first name in the order the smallest
stride, so with expert parallelism 1 (the dense models trained here)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Its docstring's example agrees: 16 GPUs, tp 2, pp 4 give data-parallel groups [g0, g2], [g1, g3], ...
and pipeline groups [g0, g4, g8, g12], .... MegatronTrainer checks at setup that the data-parallel rank
Megatron gives each process is :func:`dp_rank_of` its rank, so a different order fails loudly at once.

Balance. :func:`shard_batch` hands the samples out longest first, each to the replica with the fewest
tokens so far (ties: the lower replica; equal lengths: the lower index), so every rank computes the
same split without talking and the replicas' loads differ by at most the longest sample.
"""

from __future__ import annotations

from typing import Sequence


def dp_size(world_size: int, tp: int, pp: int, cp: int) -> int:
    """Data-parallel replicas in ``world_size`` ranks with tensor/pipeline/context sizes ``tp, pp, cp``."""
    model = tp * pp * cp
    if min(world_size, tp, pp, cp) < 1 or world_size % model:
        raise ValueError(f"{world_size} trainer ranks do not split into replicas of "
                         f"tp {tp} x pp {pp} x cp {cp}")
    return world_size // model


def dp_rank_of(rank: int, world_size: int, tp: int, pp: int, cp: int) -> int:
    """The data-parallel replica of global ``rank`` in Megatron's default order (module docstring)."""
    dp = dp_size(world_size, tp, pp, cp)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return (rank // (tp * cp)) % dp


def replica_leads(world_size: int, tp: int, pp: int, cp: int) -> list[int]:
    """One rank per replica, in replica order: the one whose tp, cp and pp coordinates are 0. Per-replica
    counts (trained samples and tokens) are summed over these, so a replica's shard counts once."""
    return [tp * cp * d for d in range(dp_size(world_size, tp, pp, cp))]


def shard_batch(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Sample indices per data-parallel replica, balanced by ``lengths`` (tokens), each shard in the
    order its samples were handed out (longest first). Every index lands in exactly one shard."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = loads.index(min(loads))
        shards[r].append(i)
        loads[r] += lengths[i]
    return shards


def rank_shards(lengths: Sequence[int], world_size: int, tp: int, pp: int, cp: int) -> list[list[int]]:
    """Sample indices per global rank: each rank gets its replica's shard (the same list, the same order,
    for every rank of a replica)."""
    shards = shard_batch(lengths, dp_size(world_size, tp, pp, cp))
    return [list(shards[dp_rank_of(r, world_size, tp, pp, cp)]) for r in range(world_size)]
