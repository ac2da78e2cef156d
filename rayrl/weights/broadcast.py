"""The broadcast transport: the trainer's sending rank and every engine rank in one process group.

Engines on any node (the only transport that crosses nodes). The sender is rank 0; engine ``i``'s
tensor-parallel rank ``r`` joins as ``rank_offset_i + r`` through ``/init_weights_update_group``. Each
bucket is announced with ``/update_weights_from_distributed`` (names, dtypes, shapes) and then broadcast
tensor by tensor (or as one flattened tensor). NCCL on GPU, gloo on CPU: the same code. A bucket an engine
refuses leaves the group out of step; the sender says so and must be closed and connected again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional, Sequence

import torch

from rayrl.ports import free_port
from rayrl.weights.group import broadcast_tensors, destroy_group, dtype_name, init_custom_process_group
from rayrl.weights.transfer import (
    DEFAULT_BUCKET_BYTES,
    EngineTarget,
    NamedTensors,
    TransferStats,
    WeightTransferError,
    check_results,
    close_clients,
    iter_buckets,
    verify_version,
    with_last,
)

logger = logging.getLogger(__name__)


class BroadcastSender:
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
            check_results(results, self.engines, "init_weights_update_group")
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
        for bucket, last in with_last(buckets):
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
            check_results(results, self.engines, "update_weights_from_distributed")
            stats.add_bucket(tensors)
        stats.seconds = time.perf_counter() - started
        await verify_version(self.engines, version)
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
        await close_clients(self.engines)
