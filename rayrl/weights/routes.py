"""Which trainer rank sends weights to which engine, over which transport: the one place that picks.

Inputs are where things run (node and placement bundle of every engine and trainer rank, as the Ray
layer found them) and ``pipeline.weight_transfer``. The three transports differ in reach:

- ``distributed`` (rayrl/weights/broadcast.py) crosses nodes: trainer rank 0 broadcasts to every engine;
- ``disk`` (disk.py) and ``tensor`` (handles.py) hand over a path or memory handles, which only mean
  something on the sender's node: each engine gets them from a trainer rank on its own node (the rank on
  its first bundle when colocated, else the lowest rank there). Every torch rank holds the full weights
  after a step (data parallel), and every Megatron rank drains the gathered export, so any rank can send.

``auto`` takes the fastest transport that reaches every engine: on CPU engines ``tensor`` (shared-memory
handles: 6.5x faster than ``disk`` and 5x faster than a gloo broadcast for SmolLM2-135M, bench/weight_transfer.py)
when every engine has a trainer rank on its node, else ``distributed`` (gloo); on GPU ``tensor`` (CUDA
IPC) when every engine shares its first bundle with a trainer rank (colocated), else ``distributed``
(NCCL). ``disk`` is there to be asked for (it needs nothing but a shared-memory directory). One
transport per run, so a rank holds at most one sender and the trainer never asks which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence

from rayrl.engines.client import EngineClient
from rayrl.weights.broadcast import BroadcastSender
from rayrl.weights.disk import DiskSender
from rayrl.weights.handles import HandleSender
from rayrl.weights.shm import owner_tag
from rayrl.weights.transfer import EngineTarget, WeightSender

Transport = Literal["disk", "tensor", "distributed"]
TRANSPORTS: tuple[str, ...] = ("disk", "tensor", "distributed")
NODE_LOCAL: tuple[str, ...] = ("disk", "tensor")


class WeightRouteError(ValueError):
    """A transport that cannot reach some engine; the message names ``pipeline.weight_transfer``."""


@dataclass(frozen=True)
class EngineEndpoint:
    """Where one engine serves: its URL, node, placement bundles (first = where its actor runs) and TP size."""

    url: str
    node_id: str
    tp_size: int = 1
    bundles: tuple[int, ...] = ()


@dataclass(frozen=True)
class RankPlace:
    """Where one trainer rank runs: its node and placement bundle (None outside a shared placement)."""

    rank: int
    node_id: str
    bundle: Optional[int] = None


@dataclass(frozen=True)
class WeightRoutes:
    """The resolved transport and, per sending rank, the engines (indices into ``engines``) it feeds."""

    transport: Transport
    engines: tuple[EngineEndpoint, ...]
    by_rank: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def engines_of(self, rank: int) -> list[EngineEndpoint]:
        return [self.engines[i] for i in self.by_rank.get(rank, ())]

    def describe(self) -> str:
        parts = [f"rank {r} -> {', '.join(self.engines[i].url for i in idx)}" for r, idx in sorted(self.by_rank.items())]
        return f"{self.transport}: " + "; ".join(parts)


def _local_sender_rank(engine: EngineEndpoint, ranks: Sequence[RankPlace]) -> Optional[int]:
    """The rank on the engine's first bundle, else the lowest rank on its node, else None."""
    if engine.bundles:
        for place in ranks:
            if place.bundle is not None and place.bundle == engine.bundles[0]:
                return place.rank
    on_node = [p.rank for p in ranks if p.node_id == engine.node_id]
    return min(on_node) if on_node else None


def _shares_bundle(engine: EngineEndpoint, ranks: Sequence[RankPlace]) -> bool:
    return bool(engine.bundles) and any(p.bundle == engine.bundles[0] for p in ranks if p.bundle is not None)


def resolve_transport(
    mode: str, engines: Sequence[EngineEndpoint], ranks: Sequence[RankPlace], engine_backend: str
) -> Transport:
    """``pipeline.weight_transfer`` made concrete for where the engines and ranks actually run."""
    if mode in TRANSPORTS:
        return mode  # type: ignore[return-value]
    if mode != "auto":
        raise WeightRouteError(f"pipeline.weight_transfer: {mode!r} is not one of auto, {', '.join(TRANSPORTS)}")
    if engine_backend == "cpu":
        local = all(_local_sender_rank(e, ranks) is not None for e in engines)
        return "tensor" if local else "distributed"
    return "tensor" if all(_shares_bundle(e, ranks) for e in engines) else "distributed"


def plan_routes(
    mode: str, engines: Sequence[EngineEndpoint], ranks: Sequence[RankPlace], engine_backend: str
) -> WeightRoutes:
    """Which rank feeds which engine; raises WeightRouteError when a node-local transport was asked for
    and some engine has no trainer rank on its node."""
    if not engines:
        raise WeightRouteError("no engines to send weights to")
    if not ranks:
        raise WeightRouteError("no trainer ranks to send weights from")
    transport = resolve_transport(mode, engines, ranks, engine_backend)
    by_rank: dict[int, list[int]] = {}
    if transport == "distributed":
        lowest = min(p.rank for p in ranks)
        by_rank[lowest] = list(range(len(engines)))
    else:
        for i, engine in enumerate(engines):
            rank = _local_sender_rank(engine, ranks)
            if rank is None:
                raise WeightRouteError(
                    f"pipeline.weight_transfer: {transport} hands weights over on one node, but the engine at "
                    f"{engine.url} (node {engine.node_id[:12]}) has no trainer rank on its node; use distributed "
                    "or auto"
                )
            by_rank.setdefault(rank, []).append(i)
    return WeightRoutes(transport, tuple(engines), {r: tuple(v) for r, v in by_rank.items()})


def make_sender(
    routes: WeightRoutes,
    rank: int,
    *,
    bucket_bytes: int,
    timeout_s: float,
    master_address: str,
    disk_root: str | Path,
    cuda: bool,
) -> Optional[WeightSender]:
    """The sender rank ``rank`` needs under ``routes`` (None: it feeds no engine). ``connect()`` it before
    the first ``send``. ``disk_root`` is this run's directory for the disk transport (a directory per rank
    process is made under it, ``rank<r>-<pid>-<start>``: rayrl/weights/shm.py); ``master_address`` is the
    address other nodes reach this rank at (broadcast)."""
    endpoints = routes.engines_of(rank)
    if not endpoints:
        return None
    targets = [EngineTarget(EngineClient(e.url, timeout_s=timeout_s), e.tp_size) for e in endpoints]
    if routes.transport == "disk":  # the directory names its owner, so a sweep removes it if the rank is killed
        return DiskSender(targets, Path(disk_root) / f"rank{rank}-{owner_tag()}", timeout_s=timeout_s)
    if routes.transport == "tensor":
        return HandleSender(targets, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    return BroadcastSender(targets, backend="nccl" if cuda else "gloo", master_address=master_address,
                           bucket_bytes=bucket_bytes, timeout_s=timeout_s)
