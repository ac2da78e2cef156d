"""Trainer -> engine weight transfer without disk: bucketed, versioned, through SGLang's own endpoints.

Two transports, chosen by where the engines are:

- :class:`DistributedWeightSender` (engines on other GPUs / other processes): the trainer's rank 0 and
  every engine rank form one broadcast group (``/init_weights_update_group``); each bucket is announced
  with ``/update_weights_from_distributed`` (names, dtypes, shapes) and then broadcast tensor by tensor
  (or as one flattened tensor). gloo on CPU, NCCL on GPU: the same code.
- :class:`TensorWeightSender` (engines on the trainer's own GPUs, colocated): each bucket is serialized
  as handles (CUDA IPC on GPU, shared memory on CPU) and posted with ``/update_weights_from_tensor``;
  the engine maps the trainer's memory and copies, so no bytes cross HTTP.

Both take ``(hf_name, tensor)`` pairs from any iterator (TorchTrainer.named_weights, or mbridge's
``export_weights`` on the Megatron backend, which every rank must drain), cut them into buckets of
``bucket_bytes``, and set the engines' ``weight_version`` with the last bucket only: until then the
engines still report the old version, so a sample is never tagged with weights that were half loaded.
Generation should be paused around ``send`` (actors/pipeline.py does it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from rayrl.config import TrainerConfig
from rayrl.engines.client import EngineClient
from rayrl.engines.launcher import free_port
from rayrl.engines.weight_group import (
    broadcast_tensors,
    destroy_group,
    dtype_name,
    init_custom_process_group,
)
from rayrl.engines.weights import flatten_bucket, serialize_for_engine, shared_cpu_buffer

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024  # slime/verl send 0.5-1 GB buckets; memory cost is one bucket


class WeightTransferError(RuntimeError):
    """An engine refused a bucket or the broadcast failed; the engines may hold a mix of versions."""


NamedTensors = Iterable[tuple[str, torch.Tensor]]


def iter_buckets(
    named_tensors: NamedTensors, bucket_bytes: int, one_dtype: bool = False
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger tensor travels alone).

    ``one_dtype`` also closes a bucket when the dtype changes (flattened buckets are one tensor).
    The input is consumed lazily, so at most one bucket is held at a time.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        dtype_change = one_dtype and bucket and bucket[-1][1].dtype != tensor.dtype
        if bucket and (size + nbytes > bucket_bytes or dtype_change):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _with_last(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """``(item, is_last)`` with one item of look-ahead."""
    try:
        current = next(items)
    except StopIteration:
        return
    for following in items:
        yield current, False
        current = following
    yield current, True


@dataclass
class EngineTarget:
    """One engine server: its client and how many tensor-parallel ranks it has (each joins the group)."""

    client: EngineClient
    tp_size: int = 1


@dataclass
class TransferStats:
    version: str
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


def _check(results: Sequence[Any], engines: Sequence[EngineTarget], what: str) -> None:
    for engine, result in zip(engines, results):
        if isinstance(result, BaseException):
            raise WeightTransferError(f"{what} failed on {engine.client.base_url}: {result}") from result
        if isinstance(result, dict) and result.get("success") is False:
            raise WeightTransferError(f"{what} refused by {engine.client.base_url}: {result.get('message')}")


async def _verify_version(engines: Sequence[EngineTarget], version: str) -> None:
    seen = await asyncio.gather(*(e.client.get_weight_version() for e in engines))
    wrong = [(e.client.base_url, v) for e, v in zip(engines, seen) if v != version]
    if wrong:
        raise WeightTransferError(f"engines report another weight version than {version!r}: {wrong}")


class DistributedWeightSender:
    """Rank 0 of a trainer broadcasting to every engine rank (NCCL on GPU, gloo on CPU)."""

    def __init__(
        self,
        engines: Sequence[EngineTarget],
        *,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        master_port: Optional[int] = None,
        group_name: str = "weight_update_group",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        flattened: bool = False,
        device: Optional[torch.device] = None,
        timeout_s: float = 300.0,
    ) -> None:
        if not engines:
            raise ValueError("no engines to send weights to")
        self.engines = list(engines)
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port or free_port(master_address)
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self.flattened = flattened
        self.device = device or torch.device("cuda" if backend == "nccl" else "cpu")
        self.timeout_s = timeout_s
        self.world_size = 1 + sum(e.tp_size for e in self.engines)
        self._group: Any = None

    async def connect(self) -> None:
        """Create the group: every engine joins (over HTTP) while this process joins as rank 0."""
        loop = asyncio.get_running_loop()
        offsets, offset = [], 1
        for e in self.engines:
            offsets.append(offset)
            offset += e.tp_size
        joins = [
            asyncio.ensure_future(
                e.client.init_weights_update_group(
                    self.master_address,
                    self.master_port,
                    rank_offset,
                    self.world_size,
                    self.group_name,
                    self.backend,
                    timeout_s=self.timeout_s + 30,
                )
            )
            for e, rank_offset in zip(self.engines, offsets)
        ]
        mine = loop.run_in_executor(
            None,
            lambda: init_custom_process_group(
                self.backend,
                self.master_address,
                self.master_port,
                0,
                self.world_size,
                self.group_name,
                self.timeout_s,
            ),
        )
        results = await asyncio.gather(*joins, return_exceptions=True)
        try:
            _check(results, self.engines, "init_weights_update_group")
        except WeightTransferError:
            for j in joins:
                j.cancel()
            raise  # our own rendezvous thread gives up at its timeout
        self._group = await mine

    async def send(self, named_tensors: NamedTensors, version: str | int) -> TransferStats:
        """Broadcast every tensor, bucket by bucket; the last bucket sets ``weight_version``."""
        if self._group is None:
            raise WeightTransferError("connect() first")
        version = str(version)
        loop = asyncio.get_running_loop()
        stats = TransferStats(version)
        started = time.perf_counter()
        buckets = iter_buckets(named_tensors, self.bucket_bytes, one_dtype=self.flattened)
        for bucket, last in _with_last(buckets):
            tensors = [t.detach().to(self.device) for _, t in bucket]
            announce = [
                asyncio.ensure_future(
                    e.client.update_weights_from_distributed(
                        [n for n, _ in bucket],
                        [dtype_name(t.dtype) for t in tensors],
                        [list(t.shape) for t in tensors],
                        group_name=self.group_name,
                        flush_cache=last,
                        weight_version=version if last else None,
                        load_format="flattened_bucket" if self.flattened else None,
                        timeout_s=self.timeout_s + 30,
                    )
                )
                for e in self.engines
            ]
            broadcast = loop.run_in_executor(None, broadcast_tensors, self._group, tensors, self.flattened)
            done, _ = await asyncio.wait([broadcast, *announce], return_when=asyncio.FIRST_EXCEPTION)
            early = [f for f in done if f is not broadcast and f.exception() is not None]
            if early:  # an engine refused the bucket before receiving: the broadcast can never finish
                raise WeightTransferError(
                    f"an engine refused bucket {stats.buckets} ({early[0].exception()}); the broadcast group "
                    "is out of step: close() this sender and connect a new one"
                )
            results = await asyncio.gather(*announce, return_exceptions=True)
            await broadcast
            _check(results, self.engines, "update_weights_from_distributed")
            stats.buckets += 1
            stats.tensors += len(tensors)
            stats.bytes += sum(t.numel() * t.element_size() for t in tensors)
        stats.seconds = time.perf_counter() - started
        await _verify_version(self.engines, version)
        logger.info(
            "weights v%s broadcast to %d engine(s): %d tensors, %.1f MB in %d buckets, %.2f GB/s",
            version, len(self.engines), stats.tensors, stats.bytes / 1e6, stats.buckets, stats.gb_per_s,
        )  # fmt: skip
        return stats

    async def close(self) -> None:
        """Destroy the group on the engines and here (engines that are gone are skipped)."""
        if self._group is None:
            return
        results = await asyncio.gather(
            *(e.client.destroy_weights_update_group(self.group_name) for e in self.engines),
            return_exceptions=True,
        )
        for e, r in zip(self.engines, results):
            if isinstance(r, Exception):
                logger.warning("destroy_weights_update_group on %s: %s", e.client.base_url, r)
        destroy_group(self._group)
        self._group = None


class TensorWeightSender:
    """Colocated transfer: buckets as IPC/shared-memory handles through ``/update_weights_from_tensor``.

    ``payloads_for_ranks`` turns this rank's serialized bucket into one payload per engine TP rank.
    The default repeats it (one trainer process feeds the engine). With several trainer ranks sharing
    GPUs with a TP engine, pass a function that gathers each GPU's own payload (:func:`gather_payloads`),
    so every engine rank maps memory on its own device.
    """

    def __init__(
        self,
        engines: Sequence[EngineTarget],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        flattened: bool = True,
        payloads_for_ranks: Optional[Callable[[str, EngineTarget], list[str]]] = None,
        timeout_s: float = 300.0,
    ) -> None:
        if not engines:
            raise ValueError("no engines to send weights to")
        self.engines = list(engines)
        self.bucket_bytes = bucket_bytes
        self.flattened = flattened
        self.payloads_for_ranks = payloads_for_ranks or (lambda payload, engine: [payload] * engine.tp_size)
        self.timeout_s = timeout_s
        self._buffer: Optional[torch.Tensor] = None

    def _bucket_object(self, bucket: list[tuple[str, torch.Tensor]]) -> Any:
        if self.flattened:
            dtype, numel = bucket[0][1].dtype, sum(t.numel() for _, t in bucket)
            if bucket[0][1].device.type != "cpu":
                return flatten_bucket(bucket)  # on GPU: one device copy, then an IPC handle
            # on CPU: fill one shared-memory buffer, reused by every bucket (the engine has copied the
            # previous one before we get here), so pickling moves no bytes and no new pages are touched
            if self._buffer is None or self._buffer.dtype != dtype or self._buffer.numel() < numel:
                self._buffer = shared_cpu_buffer(max(numel, self.bucket_bytes // bucket[0][1].element_size()), dtype)
            return flatten_bucket(bucket, out=self._buffer)
        # CPU storages are moved into shared memory when pickled: share copies, not the trainer's params.
        return [(n, t.detach().clone() if t.device.type == "cpu" else t.detach()) for n, t in bucket]

    async def send(self, named_tensors: NamedTensors, version: str | int) -> TransferStats:
        version = str(version)
        stats = TransferStats(version)
        started = time.perf_counter()
        buckets = iter_buckets(named_tensors, self.bucket_bytes, one_dtype=self.flattened)
        for bucket, last in _with_last(buckets):
            obj = self._bucket_object(bucket)  # stays referenced until every engine has answered
            payload = serialize_for_engine(obj)
            results = await asyncio.gather(
                *(
                    e.client.update_weights_from_serialized(
                        self.payloads_for_ranks(payload, e),
                        load_format="flattened_bucket" if self.flattened else None,
                        flush_cache=last,
                        weight_version=version if last else None,
                        timeout_s=self.timeout_s,
                    )
                    for e in self.engines
                ),
                return_exceptions=True,
            )
            del obj
            _check(results, self.engines, "update_weights_from_tensor")
            stats.buckets += 1
            stats.tensors += len(bucket)
            stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        stats.seconds = time.perf_counter() - started
        await _verify_version(self.engines, version)
        logger.info(
            "weights v%s handed to %d colocated engine(s): %d tensors, %.1f MB in %d buckets, %.2f GB/s",
            version, len(self.engines), stats.tensors, stats.bytes / 1e6, stats.buckets, stats.gb_per_s,
        )  # fmt: skip
        return stats


TRANSFERS = ("disk", "tensor", "distributed")


def resolve_weight_transfer(mode: str, engine_backend: str, placement_mode: str) -> str:
    """``pipeline.weight_transfer`` made concrete: ``auto`` is ``disk`` for CPU engines (a safetensors
    file in /dev/shm: a copy in RAM either way, no group to keep, and a restarted engine reloads it), and on GPU ``tensor`` (CUDA IPC) when the engines share the
    trainer's GPUs (``placement.mode: colocated``), else ``distributed`` (an NCCL broadcast group)."""
    if mode in TRANSFERS:
        return mode
    if mode != "auto":
        raise ValueError(f"pipeline.weight_transfer must be auto or one of {', '.join(TRANSFERS)}, got {mode!r}")
    if engine_backend == "cpu":
        return "disk"
    return "tensor" if placement_mode == "colocated" else "distributed"


def sender_for(
    cfg: TrainerConfig,
    engine_urls: Sequence[str],
    *,
    colocated: bool,
    engine_tp_size: int = 1,
    master_address: str = "127.0.0.1",
    timeout_s: float = 300.0,
) -> DistributedWeightSender | TensorWeightSender:
    """The sender a run needs: IPC/shared-memory handles when the engines share the trainer's devices,
    a broadcast group (NCCL with CUDA, else gloo) otherwise; buckets of ``trainer.weight_bucket_mb``.
    A DistributedWeightSender must be ``connect()``-ed before its first ``send``."""
    engines = [EngineTarget(EngineClient(url, timeout_s=timeout_s), engine_tp_size) for url in engine_urls]
    bucket = cfg.weight_bucket_mb * 1024 * 1024
    if colocated:
        return TensorWeightSender(engines, bucket_bytes=bucket, timeout_s=timeout_s)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return DistributedWeightSender(
        engines, backend=backend, master_address=master_address, bucket_bytes=bucket, timeout_s=timeout_s
    )


def gather_payloads(payload: str, group: Any, dst: int) -> Optional[list[str]]:
    """Collect every rank's serialized bucket on ``dst`` (global rank), in group-rank order.

    Colocated TP engines: the trainer ranks on an engine's GPUs each serialize their own copy (CUDA IPC
    handles of memory on their GPU); the rank that talks to the engine posts the list, so engine TP rank
    ``r`` opens memory on its own GPU. Returns the list on ``dst`` and None elsewhere.
    """
    import torch.distributed as dist

    size = dist.get_world_size(group)
    out: Optional[list[Any]] = [None] * size if dist.get_rank() == dst else None
    dist.gather_object(payload, out, dst=dst, group=group)
    return out
