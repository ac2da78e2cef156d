"""Which trainer rank feeds which engine, over which transport (rayrl/weights/plan.py): pure rules."""

from __future__ import annotations

import pytest

from rayrl.weights.broadcast import BroadcastSender
from rayrl.weights.disk import DiskSender
from rayrl.weights.handles import HandleSender
from rayrl.weights.owners import owner_tag
from rayrl.weights.plan import EngineEndpoint, RankPlace, WeightPlanError, make_sender, plan_senders


def _colocated(nodes: list[str]) -> tuple[list[EngineEndpoint], list[RankPlace]]:
    """Engine i and rank i share bundle i on nodes[i] (bundles numbered out of node order on purpose)."""
    bundles = list(reversed(range(len(nodes))))
    engines = [EngineEndpoint(f"http://e{i}", n, 1, (b,)) for i, (n, b) in enumerate(zip(nodes, bundles))]
    ranks = [RankPlace(i, n, b) for i, (n, b) in enumerate(zip(nodes, bundles))]
    return engines, ranks


def test_colocated_over_nodes_feeds_each_engine_from_its_own_bundle():
    engines, ranks = _colocated(["A", "B", "C"])
    cpu = plan_senders("auto", engines, ranks, "cpu")
    assert cpu.transport == "tensor" and cpu.by_rank == {0: (0,), 1: (1,), 2: (2,)}  # shared-memory handles
    gpu = plan_senders("auto", engines, ranks, "sglang")
    assert gpu.transport == "tensor" and gpu.by_rank == cpu.by_rank  # CUDA IPC to the engine on its GPU


def test_split_over_nodes_broadcasts_from_rank_0():
    engines = [EngineEndpoint("http://e0", "B", 1, (1,)), EngineEndpoint("http://e1", "C", 1, (2,))]
    ranks = [RankPlace(0, "A", 0)]
    for backend in ("cpu", "sglang"):
        plan = plan_senders("auto", engines, ranks, backend)
        assert plan.transport == "distributed" and plan.by_rank == {0: (0, 1)}
    with pytest.raises(WeightPlanError, match=r"pipeline.weight_transfer: disk .*http://e0.*use distributed"):
        plan_senders("disk", engines, ranks, "cpu")


def test_split_on_one_node_uses_the_fastest_local_transport():
    """Host memory reaches every process on the node; a GPU's handles only processes that see that GPU."""
    engines = [EngineEndpoint("http://e0", "A", 1), EngineEndpoint("http://e1", "A", 1)]
    ranks = [RankPlace(0, "A"), RankPlace(1, "A")]
    assert plan_senders("auto", engines, ranks, "cpu").by_rank == {0: (0, 1)}  # the lowest rank on the node
    placed = [EngineEndpoint("http://e0", "A", 1, (2,)), EngineEndpoint("http://e1", "A", 1, (3,))]
    placed_ranks = [RankPlace(0, "A", 0), RankPlace(1, "A", 1)]
    for backend in ("sglang", "cpu"):  # engines on other (logical) GPUs than the trainer's
        assert plan_senders("auto", placed, placed_ranks, backend).transport == "distributed"
        # SGLang 0.5.9 maps a handle's GPU among those it sees (CUDA_VISIBLE_DEVICES: its own bundles') or dies
        with pytest.raises(WeightPlanError, match=r"pipeline.weight_transfer: tensor .*http://e0.*bundles \[2\]"):
            plan_senders("tensor", placed, placed_ranks, backend)


def test_partly_remote_engines_fall_back_to_a_broadcast_under_auto():
    engines = [EngineEndpoint("http://e0", "A"), EngineEndpoint("http://e1", "B")]
    plan = plan_senders("auto", engines, [RankPlace(0, "A"), RankPlace(1, "A")], "cpu")
    assert plan.transport == "distributed" and plan.by_rank == {0: (0, 1)}  # rank 1 sends to none


def test_bad_inputs_name_the_field():
    engines, ranks = _colocated(["A"])
    with pytest.raises(WeightPlanError, match="pipeline.weight_transfer: 'fast'"):
        plan_senders("fast", engines, ranks, "cpu")
    with pytest.raises(WeightPlanError, match="no engines"):
        plan_senders("auto", [], ranks, "cpu")


def test_make_sender_gives_each_rank_its_transport(tmp_path):
    engines, ranks = _colocated(["A", "B"])
    kwargs = {"bucket_bytes": 1 << 20, "timeout_s": 5, "master_address": "127.0.0.1", "disk_root": tmp_path,
              "cuda": False}
    disk = make_sender(plan_senders("disk", engines, ranks, "cpu"), 1, **kwargs)
    assert isinstance(disk, DiskSender) and disk.root == tmp_path / f"rank1-{owner_tag()}" and len(disk.engines) == 1
    assert isinstance(make_sender(plan_senders("auto", engines, ranks, "cpu"), 0, **kwargs), HandleSender)
    broadcast = plan_senders("distributed", engines, ranks, "cpu")
    assert isinstance(make_sender(broadcast, 0, **kwargs), BroadcastSender)
    assert make_sender(broadcast, 1, **kwargs) is None  # rank 1 feeds nobody


def _tp2_colocated() -> tuple[list[EngineEndpoint], list[RankPlace]]:
    """Two tp=2 engines colocated with four ranks: engine j on bundles (2j+1, 2j) (TP rank 0's first), rank
    r on bundle r; so engine 0's TP ranks read the GPUs of ranks 1 and 0, engine 1's those of 3 and 2."""
    engines = [EngineEndpoint(f"http://e{j}", "A", 2, (2 * j + 1, 2 * j)) for j in range(2)]
    return engines, [RankPlace(r, "A", r) for r in range(4)]


def test_tensor_parallel_engines_get_one_payload_per_tp_rank_from_the_rank_on_its_gpu():
    """Issue 25 point 2: each TP rank's entry is made by the trainer rank on that rank's GPU; the rank on the
    engine's first GPU posts them all. auto picks tensor for them again, and the config no longer refuses it."""
    from rayrl.config import load_config

    load_config(None, ["engine.backend=sglang", "engine.tp_size=2", "pipeline.weight_transfer=tensor"])
    engines, ranks = _tp2_colocated()
    for backend in ("sglang", "cpu"):  # SGLang on GPUs, or the CPU engine placed on logical GPUs
        plan = plan_senders("auto", engines, ranks, backend)
        assert plan.transport == "tensor" and plan_senders("tensor", engines, ranks, backend).transport == "tensor"
        assert plan.tp_ranks == {0: (1, 0), 1: (3, 2)}  # in TP order
        assert plan.by_rank == {1: (0,), 3: (1,)}  # TP rank 0's trainer rank posts
        assert [plan.contributions_of(r) for r in range(4)] == [[(0, 1)], [], [(1, 1)], []]
    missing = [RankPlace(0, "A", 0), RankPlace(1, "A", 1), RankPlace(2, "A", 2)]  # bundle 3 has no rank
    assert plan_senders("auto", engines, missing, "sglang").transport == "distributed"
    with pytest.raises(WeightPlanError, match=r"tensor .*http://e1.*bundles \[3, 2\].*use distributed or auto"):
        plan_senders("tensor", engines, missing, "sglang")
    # plain CPU (no placement): host memory, one payload serves every TP rank of the engine
    plain = plan_senders("auto", [EngineEndpoint("http://e", "A", 2)], [RankPlace(0, "A")], "cpu")
    assert plain.transport == "tensor" and plain.by_rank == {0: (0,)} and plain.tp_ranks == {}


def test_make_sender_gives_the_ranks_of_a_tp_engine_their_part(tmp_path):
    import torch.distributed as dist

    engines, ranks = _tp2_colocated()
    plan = plan_senders("auto", engines, ranks, "sglang")
    store = dist.HashStore()
    kwargs = {"bucket_bytes": 1 << 20, "timeout_s": 5, "master_address": "127.0.0.1", "disk_root": tmp_path,
              "cuda": False, "store": store}
    poster, member = make_sender(plan, 1, **kwargs), make_sender(plan, 0, **kwargs)
    assert isinstance(poster, HandleSender) and [(e.tp_size, e.exchange_key) for e in poster.engines] == [(2, 0)]
    assert poster.contributes == [] and poster.exchange is not None
    assert isinstance(member, HandleSender) and member.engines == [] and member.contributes == [(0, 1)]
    with pytest.raises(WeightPlanError, match="store"):
        make_sender(plan, 0, **{**kwargs, "store": None})
