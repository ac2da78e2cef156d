"""Data-parallel sharding (rayrl/rl/shard.py): Megatron's rank order, one shard per replica shared by
all its ranks, every sample trained once, loads balanced; and TrainerGroup's use of it, without Ray."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayrl.rl.shard import dp_rank_of, dp_size, rank_shards, replica_leads, shard_batch

LAYOUTS = [  # (world, tp, pp, cp)
    (1, 1, 1, 1), (4, 1, 1, 1), (8, 2, 1, 1), (8, 1, 2, 1), (8, 1, 1, 2), (8, 2, 2, 1), (16, 2, 4, 1),
    (16, 2, 2, 2), (24, 2, 3, 2), (12, 3, 1, 1), (8, 8, 1, 1), (8, 1, 8, 1),
]


def _megatron_coords(world: int, tp: int, pp: int, cp: int) -> dict[int, tuple[int, int, int, int]]:
    """rank -> (tp_rank, cp_rank, dp_rank, pp_rank), enumerating order tp-cp-dp-pp with tp fastest."""
    dp = world // (tp * pp * cp)
    out = {}
    for rank, (p, d, c, t) in enumerate(itertools.product(range(pp), range(dp), range(cp), range(tp))):
        out[rank] = (t, c, d, p)
    return out


@pytest.mark.parametrize("world,tp,pp,cp", LAYOUTS)
def test_rank_mapping_follows_megatron_order(world, tp, pp, cp):
    assert dp_size(world, tp, pp, cp) == world // (tp * pp * cp)
    coords = _megatron_coords(world, tp, pp, cp)
    assert [dp_rank_of(r, world, tp, pp, cp) for r in range(world)] == [coords[r][2] for r in range(world)]
    leads = [r for r in range(world) if coords[r][0] == coords[r][1] == coords[r][3] == 0]
    assert replica_leads(world, tp, pp, cp) == leads


def test_megatron_docstring_example():
    # initialize_model_parallel's docstring: 16 GPUs, tp 2, pp 4 -> data-parallel groups
    # [g0, g2], [g1, g3], [g4, g6], [g5, g7], [g8, g10], [g9, g11], [g12, g14], [g13, g15]
    groups = [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    for group in groups:
        assert [dp_rank_of(r, 16, 2, 4, 1) for r in group] == [0, 1]
    # tp 2, cp 2, dp 2 on 8 ranks: the first four ranks are replica 0 (tp and cp vary fastest)
    assert [dp_rank_of(r, 8, 2, 1, 2) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert replica_leads(8, 2, 1, 2) == [0, 4]


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="do not split"):
        dp_size(6, 4, 1, 1)
    with pytest.raises(ValueError, match="do not split"):
        dp_size(4, 0, 1, 1)
    with pytest.raises(ValueError, match="outside"):
        dp_rank_of(4, 4, 1, 1, 1)
    with pytest.raises(ValueError):
        shard_batch([1, 2], 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), max_size=64), st.integers(1, 9))
def test_every_sample_once_and_balanced(lengths, dp):
    shards = shard_batch(lengths, dp)
    assert len(shards) == dp
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lengths, default=0)
    assert shard_batch(list(lengths), dp) == shards  # deterministic: every rank computes the same split


def test_longest_first_to_least_loaded_ties_by_index():
    assert shard_batch([5, 9, 5, 1, 9], 2) == [[1, 0, 3], [4, 2]]
    assert shard_batch([3, 3, 3], 4) == [[0], [1], [2], []]
    assert shard_batch([], 3) == [[], [], []]


@pytest.mark.parametrize("world,tp,pp,cp", LAYOUTS)
def test_ranks_of_one_replica_get_the_same_shard(world, tp, pp, cp):
    lengths = [(37 * i) % 101 + 1 for i in range(23)]
    per_rank = rank_shards(lengths, world, tp, pp, cp)
    assert len(per_rank) == world
    replicas = shard_batch(lengths, dp_size(world, tp, pp, cp))
    for r in range(world):
        assert per_rank[r] == replicas[dp_rank_of(r, world, tp, pp, cp)]
    leads = replica_leads(world, tp, pp, cp)  # one rank per replica: their shards are the batch, once
    assert [per_rank[r] for r in leads] == replicas


def test_trainer_group_counts_each_replica_once():
    """What TrainerGroup.train does with the pure functions: each rank reports what it trained; the
    batch's trained samples are the sum over one rank per replica, whatever tp/pp/cp are."""
    lengths = [10, 200, 35, 35, 90, 4, 61, 120]
    for world, tp, pp, cp in LAYOUTS:
        per_rank = rank_shards(lengths, world, tp, pp, cp)
        reports = [{"trained_samples": len(idx), "trained_tokens": sum(lengths[i] for i in idx)}
                   for idx in per_rank]
        leads = [reports[r] for r in replica_leads(world, tp, pp, cp)]
        assert sum(r["trained_samples"] for r in leads) == len(lengths)
        assert sum(r["trained_tokens"] for r in leads) == sum(lengths)


def test_torch_layout_is_the_old_per_rank_split():
    """tp = pp = cp = 1: every rank is its own replica and gets what the per-rank split gave it
    (longest first, each to the least-loaded rank, in that order)."""
    lengths = [7, 30, 30, 2, 15, 15, 40]
    # 40 -> r0; 30, 30 -> r1, r2; 15 -> r1 (30 < 40), 15 -> r2; 7 -> r0 (40 < 45); 2 -> r1 (45 < 47)
    assert rank_shards(lengths, 3, 1, 1, 1) == [[6, 0], [1, 4, 3], [2, 5]]
