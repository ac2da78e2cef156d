"""The handle transport: buckets as CUDA IPC handles (GPU) or shared-memory file names (CPU).

For engines on the sending rank's own node (colocated: on its own GPU). Each bucket is serialized as
handles with SGLang's serializer form and posted to ``/update_weights_from_tensor``; the engine maps the
trainer's memory and copies, so no tensor bytes cross HTTP. On CPU one shared-memory buffer is reused
for every bucket (rayrl/weights/shm.py: named after this process, removed on close, swept by the next
trainer or engine to start if this process is killed). A handle means nothing on another machine, which
is why rayrl/weights/routes.py only gives this transport engines that share the sender's node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional, Sequence

import torch

from rayrl.weights.transfer import (
    DEFAULT_BUCKET_BYTES,
    EngineTarget,
    NamedTensors,
    TransferStats,
    check_results,
    close_clients,
    iter_buckets,
    verify_version,
    with_last,
)
from rayrl.weights.shm import SharedBuffer
from rayrl.weights.wire import flatten_bucket, serialize_for_engine

logger = logging.getLogger(__name__)


class HandleSender:
    """Colocated transfer: buckets as IPC/shared-memory handles through ``/update_weights_from_tensor``.

    Every tensor-parallel rank of an engine gets the same payload: SGLang's serializer names the device
    by UUID, so each TP rank opens the sending rank's memory (peer access on one node).
    """

    def __init__(
        self,
        engines: Sequence[EngineTarget],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        flattened: bool = True,
        timeout_s: float = 300.0,
    ) -> None:
        if not engines:
            raise ValueError("no engines to send weights to")
        self.engines = list(engines)
        self.bucket_bytes = bucket_bytes
        self.flattened = flattened
        self.timeout_s = timeout_s
        self._buffer: Optional[SharedBuffer] = None

    async def connect(self) -> None:
        """Nothing to set up: each bucket's handles are opened by the engine when it is posted."""

    async def close(self) -> None:
        self._close_buffer()
        await close_clients(self.engines)

    def _close_buffer(self) -> None:
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    def _cpu_buffer(self, nbytes: int) -> SharedBuffer:
        """The shared-memory buffer, replaced by a larger one when a bucket needs more."""
        if self._buffer is None or self._buffer.nbytes < nbytes:
            self._close_buffer()
            self._buffer = SharedBuffer(max(nbytes, self.bucket_bytes))
        return self._buffer

    def _bucket_object(self, bucket: list[tuple[str, torch.Tensor]]) -> Any:
        if bucket[0][1].device.type != "cpu":  # on GPU: one device copy (flattened), then IPC handles
            return flatten_bucket(bucket) if self.flattened else [(n, t.detach()) for n, t in bucket]
        # on CPU: fill one shared-memory buffer, reused by every bucket (the engine has copied the previous
        # one before we get here), so pickling moves no bytes and no new pages are touched
        if self.flattened:
            dtype, numel = bucket[0][1].dtype, sum(t.numel() for _, t in bucket)
            buffer = self._cpu_buffer(numel * bucket[0][1].element_size())
            return flatten_bucket(bucket, out=buffer.typed(dtype, numel))
        return self._cpu_buffer(SharedBuffer.packed_size([t for _, t in bucket])).pack(bucket)

    async def send(self, named_tensors: NamedTensors, version: str | int) -> TransferStats:
        version = str(version)
        stats = TransferStats(version)
        started = time.perf_counter()
        buckets = iter_buckets(named_tensors, self.bucket_bytes, one_dtype=self.flattened)
        for bucket, last in with_last(buckets):
            obj = self._bucket_object(bucket)  # stays referenced until every engine has answered
            payload = serialize_for_engine(obj)
            results = await asyncio.gather(
                *(
                    e.client.update_weights_from_serialized(
                        [payload] * e.tp_size,
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
            check_results(results, self.engines, "update_weights_from_tensor")
            stats.add_bucket([t for _, t in bucket])
        stats.seconds = time.perf_counter() - started
        await verify_version(self.engines, version)
        logger.info(
            "weights v%s handed to %d colocated engine(s): %d tensors, %.1f MB in %d buckets, %.2f GB/s",
            version, len(self.engines), stats.tensors, stats.bytes / 1e6, stats.buckets, stats.gb_per_s,
        )  # fmt: skip
        return stats



