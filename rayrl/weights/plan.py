"""Which trainer rank sends weights to which engine, over which transport: the one place that picks.

Inputs are where things run (node and placement bundle of every engine and trainer rank, as the Ray
layer found them) and ``pipeline.weight_transfer``. The three transports differ in reach:

- ``distributed`` (rayrl/weights/broadcast.py) crosses nodes: trainer rank 0 broadcasts to every engine;
- ``disk`` (disk.py) hands over a path, which only means something on the sender's node: each engine gets
  it from a trainer rank on its own node (the rank on its first bundle when colocated, else the lowest
  rank there);
- ``tensor`` (handles.py) hands over memory handles. Host memory (CPU, no placement) can be read by any
  process on the node, so one rank there feeds each engine, the same payload for each of its TP ranks. A
  GPU handle can be opened only by a process that sees that GPU, and SGLang's TP rank ``r`` reads entry
  ``r``, made on its own GPU (rayrl/weights/tp_payloads.py): so where engines sit on GPUs (SGLang, or
  any engine placed on Ray's GPUs, logical ones included), each TP rank's entry is made by the trainer
  rank on that rank's GPU, which needs a trainer rank on every GPU of the engine (colocated). The rank on
  the engine's first GPU posts all entries (``tp_ranks``).

With ``trainer.lora`` the update is the adapter alone, through SGLang's LoRA routes
(rayrl/weights/adapter.py: transport ``adapter``, whatever ``pipeline.weight_transfer`` says): each engine
gets it from a trainer rank on its own node, as shared-memory handles (there is no LoRA route across
nodes in SGLang 0.5.9; an engine with no trainer rank on its node is refused here, naming trainer.lora).

Every torch rank holds the full weights after a step (data parallel), and every Megatron rank drains the
gathered export, so any rank can send.

``auto`` takes the fastest transport that reaches every engine: ``tensor`` (CUDA IPC on GPU; shared-memory
handles on CPU, the fastest here: bench/weight_transfer.py, docs/benchmarks.md) when every engine can be
fed that way (on GPUs: every GPU of every engine has a trainer rank; on CPU: every engine has one on its
node), else ``distributed`` (NCCL or gloo). ``disk`` is
there to be asked for (it needs nothing but a shared-memory directory). One transport per run, so a rank
holds at most one sender and the trainer never asks which.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional, Sequence

from rayrl.engines import backends
from rayrl.engines.client import EngineClient
from rayrl.weights.owners import owner_tag

if TYPE_CHECKING:
    from rayrl.weights.transfer import WeightSender

Transport = Literal["disk", "tensor", "distributed", "adapter"]
TRANSPORTS: tuple[str, ...] = ("disk", "tensor", "distributed")
NODE_LOCAL: tuple[str, ...] = ("disk", "tensor")


class WeightPlanError(ValueError):
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
class WeightPlan:
    """The resolved transport and, per sending rank, the engines (indices into ``engines``) it feeds."""

    transport: Transport
    engines: tuple[EngineEndpoint, ...]
    by_rank: dict[int, tuple[int, ...]] = field(default_factory=dict)
    engine_backend: str = "cpu"  # engine.backend (rayrl/engines/backends/): its GPUs and its weight wire
    # tensor transport on GPUs: engine index -> the trainer rank that makes each TP rank's entry, in TP
    # order (the first posts); engines not listed get one payload for every TP rank
    tp_ranks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # names this plan's exchange keys

    def contributions_of(self, rank: int) -> list[tuple[int, int]]:
        """The (engine index, TP rank) entries ``rank`` makes for the rank that posts them."""
        return [(i, tp) for i, ranks in sorted(self.tp_ranks.items()) for tp, r in enumerate(ranks)
                if tp and r == rank]

    def describe(self) -> str:
        def engine(i: int) -> str:
            made_by = self.tp_ranks.get(i)
            return self.engines[i].url + (f" (TP entries from ranks {', '.join(map(str, made_by))})" if made_by else "")

        parts = [f"rank {r} -> {', '.join(engine(i) for i in idx)}" for r, idx in sorted(self.by_rank.items())]
        return f"{self.transport}: " + "; ".join(parts)


def _local_sender_rank(engine: EngineEndpoint, ranks: Sequence[RankPlace]) -> Optional[int]:
    """The rank on the engine's first bundle, else the lowest rank on its node, else None."""
    if engine.bundles:
        for place in ranks:
            if place.bundle is not None and place.bundle == engine.bundles[0]:
                return place.rank
    on_node = [p.rank for p in ranks if p.node_id == engine.node_id]
    return min(on_node) if on_node else None


def _on_gpus(engine: EngineEndpoint, engine_backend: str) -> bool:
    """Whether the engine's memory is a GPU's: a GPU backend's engine (SGLang), or any engine placed on
    Ray's GPUs."""
    return backends.engine_backend(engine_backend).on_gpu or bool(engine.bundles)


def _gpu_ranks(engine: EngineEndpoint, ranks: Sequence[RankPlace]) -> Optional[tuple[int, ...]]:
    """The trainer rank on each of the engine's GPUs (bundles), in TP order; None unless every one has one."""
    on_bundle = {p.bundle: p.rank for p in ranks if p.bundle is not None}
    found = tuple(on_bundle.get(b) for b in engine.bundles)
    if len(found) < engine.tp_size or any(r is None for r in found):
        return None
    return found[: engine.tp_size]  # type: ignore[return-value]


def _tensor_reaches(engine: EngineEndpoint, ranks: Sequence[RankPlace], engine_backend: str) -> bool:
    if _on_gpus(engine, engine_backend):
        return _gpu_ranks(engine, ranks) is not None
    return _local_sender_rank(engine, ranks) is not None


def resolve_transport(
    mode: str, engines: Sequence[EngineEndpoint], ranks: Sequence[RankPlace], engine_backend: str
) -> Transport:
    """``pipeline.weight_transfer`` made concrete for where the engines and ranks actually run."""
    if mode in TRANSPORTS:
        return mode  # type: ignore[return-value]
    if mode != "auto":
        raise WeightPlanError(f"pipeline.weight_transfer: {mode!r} is not one of auto, {', '.join(TRANSPORTS)}")
    return "tensor" if all(_tensor_reaches(e, ranks, engine_backend) for e in engines) else "distributed"


def plan_senders(
    mode: str, engines: Sequence[EngineEndpoint], ranks: Sequence[RankPlace], engine_backend: str,
    lora: bool = False,
) -> WeightPlan:
    """Which rank feeds which engine; raises WeightPlanError when a node-local transport was asked for
    and some engine has no trainer rank to feed it (``tensor`` on GPUs: on each of its GPUs). ``lora``:
    the updates are LoRA adapters (transport ``adapter``, node-local)."""
    if not engines:
        raise WeightPlanError("no engines to send weights to")
    if not ranks:
        raise WeightPlanError("no trainer ranks to send weights from")
    transport: Transport = "adapter" if lora else resolve_transport(mode, engines, ranks, engine_backend)
    by_rank: dict[int, list[int]] = {}
    tp_ranks: dict[int, tuple[int, ...]] = {}
    if transport == "distributed":
        lowest = min(p.rank for p in ranks)
        by_rank[lowest] = list(range(len(engines)))
    for i, engine in enumerate(engines if transport != "distributed" else ()):
        if transport == "tensor" and _on_gpus(engine, engine_backend):
            found = _gpu_ranks(engine, ranks)
            if found is None:
                raise WeightPlanError(
                    f"pipeline.weight_transfer: tensor hands each tensor-parallel rank of the engine at {engine.url} "
                    f"a payload made on that rank's GPU, but its GPUs (bundles {list(engine.bundles)}) do not all "
                    "have a trainer rank (the colocated layout gives them one); use distributed or auto"
                )
            tp_ranks[i] = found
            by_rank.setdefault(found[0], []).append(i)
            continue
        rank = _local_sender_rank(engine, ranks)
        if rank is None and transport == "adapter":
            raise WeightPlanError(
                f"trainer.lora: the adapter goes to each engine as shared-memory handles from a trainer rank on "
                f"its node (SGLang's /load_lora_adapter_from_tensors), but the engine at {engine.url} (node "
                f"{engine.node_id[:12]}) has none; place a trainer rank on every engine node or train full weights"
            )
        if rank is None:
            raise WeightPlanError(
                f"pipeline.weight_transfer: {transport} hands weights over on one node, but the engine at "
                f"{engine.url} (node {engine.node_id[:12]}) has no trainer rank on its node; use distributed "
                "or auto"
            )
        by_rank.setdefault(rank, []).append(i)
    return WeightPlan(transport, tuple(engines), {r: tuple(v) for r, v in by_rank.items()}, engine_backend,
                      {i: r for i, r in tp_ranks.items() if len(r) > 1})


def make_sender(
    plan: WeightPlan,
    rank: int,
    *,
    bucket_bytes: int,
    timeout_s: float,
    master_address: str,
    disk_root: str | Path,
    cuda: bool,
    store: Any = None,
    gpu_id: Optional[str] = None,
    adapter_config: Optional[Mapping[str, Any]] = None,
) -> Optional[WeightSender]:
    """The sender rank ``rank`` needs under ``plan`` (None: it feeds no engine). ``connect()`` it before
    the first ``send``. ``disk_root`` is this run's directory for the disk transport (a per-rank directory
    is made under it); ``master_address`` is the address other nodes reach this rank at (broadcast);
    ``disk_root``'s per-rank directory is ``rank<r>-<pid>-<start>`` (rayrl/weights/shm.py: swept when its
    owner is killed); ``store``: the trainer world's TCP store, where the TP ranks' payloads of an engine meet
    (rayrl/weights/tp_payloads.py); ``gpu_id``: the logical GPU a CPU rank stands for (marked on its
    handle payloads); ``adapter_config``: the LoRA adapter's adapter_config.json (transport ``adapter``)."""
    # the senders (torch) are imported here, on the trainer rank that makes one: the driver only plans
    from rayrl.weights.adapter import AdapterSender
    from rayrl.weights.broadcast import BroadcastSender
    from rayrl.weights.disk import DiskSender
    from rayrl.weights.handles import HandleSender
    from rayrl.weights.tp_payloads import PayloadExchange
    from rayrl.weights.transfer import EngineTarget

    fed = plan.by_rank.get(rank, ())
    contributes = plan.contributions_of(rank)
    if not fed and not contributes:
        return None
    targets = [EngineTarget(EngineClient(plan.engines[i].url, timeout_s=timeout_s), plan.engines[i].tp_size,
                            i if i in plan.tp_ranks else None) for i in fed]
    if plan.transport == "adapter":
        if adapter_config is None:
            raise WeightPlanError("trainer.lora: the adapter transport needs the adapter's config from the trainer")
        return AdapterSender(targets, adapter_config, timeout_s=timeout_s)
    if plan.transport == "disk":
        return DiskSender(targets, Path(disk_root) / f"rank{rank}-{owner_tag()}", timeout_s=timeout_s)
    if plan.transport == "tensor":
        exchange = None
        if plan.tp_ranks:
            if store is None:
                raise WeightPlanError("pipeline.weight_transfer: tensor to tensor-parallel engines gathers each "
                                       "engine's payloads over the trainer ranks' store, and this rank has none")
            exchange = PayloadExchange(store, plan.session, timeout_s)
        return HandleSender(targets, bucket_bytes=bucket_bytes, timeout_s=timeout_s,
                            sglang_engines=backends.engine_backend(plan.engine_backend).sglang_wire,
                            exchange=exchange, contributes=contributes, gpu_id=gpu_id)
    return BroadcastSender(targets, backend="nccl" if cuda else "gloo", master_address=master_address,
                           bucket_bytes=bucket_bytes, timeout_s=timeout_s)
