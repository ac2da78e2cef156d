"""The handle transport: buckets as CUDA IPC handles (GPU) or shared-memory file names (CPU).

For engines on the sending rank's own node (colocated: on its own GPU). Each bucket is serialized as
handles with SGLang's serializer form and posted to ``/update_weights_from_tensor``; the engine maps the
trainer's memory and copies, so no tensor bytes cross HTTP. On CPU one shared-memory buffer is reused for
every bucket. A handle means nothing on another machine, which is why rayrl/weights/routes.py only gives
this transport engines that share the sender's node.
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
    WeightTransferError,
    check_results,
    close_clients,
    iter_buckets,
    verify_version,
    with_last,
)
from rayrl.weights.wire import flatten_bucket, serialize_for_engine, shared_cpu_buffer

logger = logging.getLogger(__name__)


class HandleSender:
    """Colocated transfer: buckets as IPC/shared-memory handles through ``/update_weights_from_tensor``.

    Buckets are SGLang's own ``FlattenedTensorBucket`` (SGLang's unpickler admits no other class; see
    rayrl/weights/wire.py), laid out as bytes, so one bucket holds tensors of any dtypes. An engine with
    tensor parallelism reads ``serialized_named_tensors[tp_rank]``, a payload made on the GPU that rank
    reads: one rank's handle repeated would make every TP rank map one GPU's memory. This sender holds
    one rank's tensors, so on GPU it serves engines of one TP rank (routes.py sends TP engines by
    broadcast); on CPU (one process reads shared memory) the payload is the same for every rank.
    ``sglang_engines``: the engines are SGLang (the buckets must be SGLang's classes, never ours).
    """

    def __init__(
        self,
        engines: Sequence[EngineTarget],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        flattened: bool = True,
        timeout_s: float = 300.0,
        sglang_engines: bool = False,
    ) -> None:
        if not engines:
            raise ValueError("no engines to send weights to")
        self.engines = list(engines)
        self.sglang_engines = sglang_engines
        self.bucket_bytes = bucket_bytes
        self.flattened = flattened
        self.timeout_s = timeout_s
        self._buffer: Optional[torch.Tensor] = None

    async def connect(self) -> None:
        """Nothing to set up: each bucket's handles are opened by the engine when it is posted."""

    async def close(self) -> None:
        self._buffer = None
        await close_clients(self.engines)

    def _bucket_object(self, bucket: list[tuple[str, torch.Tensor]]) -> Any:
        if self.flattened:
            if bucket[0][1].device.type != "cpu":  # on GPU: one device copy, then an IPC handle
                return flatten_bucket(bucket, require_sglang=self.sglang_engines)
            # on CPU: fill one shared-memory buffer, reused by every bucket (the engine has copied the
            # previous one before we get here), so pickling moves no bytes and no new pages are touched
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            if self._buffer is None or self._buffer.numel() < nbytes:
                self._buffer = shared_cpu_buffer(max(nbytes, self.bucket_bytes))
            return flatten_bucket(bucket, out=self._buffer, require_sglang=self.sglang_engines)
        # CPU storages are moved into shared memory when pickled: share copies, not the trainer's params.
        return [(n, t.detach().clone() if t.device.type == "cpu" else t.detach()) for n, t in bucket]

    async def send(self, named_tensors: NamedTensors, version: str | int) -> TransferStats:
        version = str(version)
        stats = TransferStats(version)
        started = time.perf_counter()
        buckets = iter_buckets(named_tensors, self.bucket_bytes)
        for bucket, last in with_last(buckets):
            on_gpu = bucket[0][1].is_cuda
            if on_gpu and any(e.tp_size > 1 for e in self.engines):
                raise WeightTransferError(
                    "a CUDA IPC payload is made on one GPU; an engine with tp_size > 1 needs one per TP rank, "
                    "made on the GPU that rank reads: use pipeline.weight_transfer=distributed for TP engines"
                )
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
            del obj, payload
            if on_gpu:  # the engines have copied: give the bucket's memory back to the driver now, so a
                torch.cuda.ipc_collect()  # colocated engine's next bucket (or its KV cache) has room
            check_results(results, self.engines, "update_weights_from_tensor")
            stats.add_bucket([t for _, t in bucket])
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        stats.seconds = time.perf_counter() - started
        await verify_version(self.engines, version)
        logger.info(
            "weights v%s handed to %d colocated engine(s): %d tensors, %.1f MB in %d buckets, %.2f GB/s",
            version, len(self.engines), stats.tensors, stats.bytes / 1e6, stats.buckets, stats.gb_per_s,
        )  # fmt: skip
        return stats



