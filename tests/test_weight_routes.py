"""Which trainer rank feeds which engine, over which transport (rayrl/weights/routes.py): pure rules."""

from __future__ import annotations

import pytest

from rayrl.weights.broadcast import BroadcastSender
from rayrl.weights.disk import DiskSender
from rayrl.weights.handles import HandleSender
from rayrl.weights.routes import EngineEndpoint, RankPlace, WeightRouteError, make_sender, plan_routes
from rayrl.weights.shm import owner_tag


def _colocated(nodes: list[str]) -> tuple[list[EngineEndpoint], list[RankPlace]]:
    """Engine i and rank i share bundle i on nodes[i] (bundles numbered out of node order on purpose)."""
    bundles = list(reversed(range(len(nodes))))
    engines = [EngineEndpoint(f"http://e{i}", n, 1, (b,)) for i, (n, b) in enumerate(zip(nodes, bundles))]
    ranks = [RankPlace(i, n, b) for i, (n, b) in enumerate(zip(nodes, bundles))]
    return engines, ranks


def test_colocated_over_nodes_feeds_each_engine_from_its_own_bundle():
    engines, ranks = _colocated(["A", "B", "C"])
    cpu = plan_routes("auto", engines, ranks, "cpu")
    assert cpu.transport == "tensor" and cpu.by_rank == {0: (0,), 1: (1,), 2: (2,)}  # shared-memory handles
    gpu = plan_routes("auto", engines, ranks, "sglang")
    assert gpu.transport == "tensor" and gpu.by_rank == cpu.by_rank  # CUDA IPC to the engine on its GPU


def test_split_over_nodes_broadcasts_from_rank_0():
    engines = [EngineEndpoint("http://e0", "B", 1, (1,)), EngineEndpoint("http://e1", "C", 1, (2,))]
    ranks = [RankPlace(0, "A", 0)]
    for backend in ("cpu", "sglang"):
        routes = plan_routes("auto", engines, ranks, backend)
        assert routes.transport == "distributed" and routes.by_rank == {0: (0, 1)}
    with pytest.raises(WeightRouteError, match=r"pipeline.weight_transfer: disk .*http://e0.*use distributed"):
        plan_routes("disk", engines, ranks, "cpu")


def test_split_on_one_node_uses_the_fastest_local_transport():
    engines = [EngineEndpoint("http://e0", "A", 1, (2,)), EngineEndpoint("http://e1", "A", 1, (3,))]
    ranks = [RankPlace(0, "A", 0), RankPlace(1, "A", 1)]
    assert plan_routes("auto", engines, ranks, "cpu").by_rank == {0: (0, 1)}  # the lowest rank on the node
    assert plan_routes("auto", engines, ranks, "sglang").transport == "distributed"  # not sharing a GPU
    assert plan_routes("tensor", engines, ranks, "sglang").transport == "tensor"  # asked: same node suffices


def test_partly_remote_engines_fall_back_to_a_broadcast_under_auto():
    engines = [EngineEndpoint("http://e0", "A"), EngineEndpoint("http://e1", "B")]
    routes = plan_routes("auto", engines, [RankPlace(0, "A"), RankPlace(1, "A")], "cpu")
    assert routes.transport == "distributed" and routes.engines_of(0) == engines and routes.engines_of(1) == []


def test_bad_inputs_name_the_field():
    engines, ranks = _colocated(["A"])
    with pytest.raises(WeightRouteError, match="pipeline.weight_transfer: 'fast'"):
        plan_routes("fast", engines, ranks, "cpu")
    with pytest.raises(WeightRouteError, match="no engines"):
        plan_routes("auto", [], ranks, "cpu")


def test_make_sender_gives_each_rank_its_transport(tmp_path):
    engines, ranks = _colocated(["A", "B"])
    kwargs = {"bucket_bytes": 1 << 20, "timeout_s": 5, "master_address": "127.0.0.1", "disk_root": tmp_path,
              "cuda": False}
    disk = make_sender(plan_routes("disk", engines, ranks, "cpu"), 1, **kwargs)
    assert isinstance(disk, DiskSender) and disk.root == tmp_path / f"rank1-{owner_tag()}" and len(disk.engines) == 1
    assert isinstance(make_sender(plan_routes("auto", engines, ranks, "cpu"), 0, **kwargs), HandleSender)
    broadcast = plan_routes("distributed", engines, ranks, "cpu")
    assert isinstance(make_sender(broadcast, 0, **kwargs), BroadcastSender)
    assert make_sender(broadcast, 1, **kwargs) is None  # rank 1 feeds nobody
