"""The handle transport: buckets as CUDA IPC handles (GPU) or shared-memory file names (CPU).

For engines on the sending rank's own node (colocated: on its own GPU). Each bucket is serialized as
handles with SGLang's serializer form and posted to ``/update_weights_from_tensor``; the engine maps the
trainer's memory and copies, so no tensor bytes cross HTTP. On CPU one shared-memory buffer is reused
for every bucket (rayrl/weights/shm.py: named after this process, removed on close, swept by the next
trainer or engine to start if this process is killed). A handle means nothing on another machine, which
is why rayrl/weights/plan.py only gives this transport engines that share the sender's node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional, Sequence

import torch

from rayrl.weights.owners import WEIGHT_BUFFERS
from rayrl.weights.shm import SharedBuffer
from rayrl.weights.tp_payloads import PayloadExchange
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
from rayrl.weights.wire import GPU_MARK, flatten_bucket, serialize_for_engine, shared_cpu_buffer

logger = logging.getLogger(__name__)


class HandleSender:
    """Colocated transfer: buckets as IPC/shared-memory handles through ``/update_weights_from_tensor``.

    Buckets are SGLang's own ``FlattenedTensorBucket`` (SGLang's unpickler admits no other class; see
    rayrl/weights/wire.py), laid out as bytes, so one bucket holds tensors of any dtypes. An engine with
    tensor parallelism reads ``serialized_named_tensors[tp_rank]``, a payload made on the GPU that rank
    reads (rayrl/weights/tp_payloads.py). For an engine whose ``EngineTarget.gathered`` is set, this rank
    makes TP rank 0's entry and the trainer ranks on the engine's other GPUs hand over theirs through
    ``exchange``; the request carries all of them in TP order. ``contributes``: the (engine, TP rank)
    entries this rank makes for another rank to post. An engine that is not gathered gets this rank's
    payload for every TP rank, which only host memory allows (CPU, no logical GPU: every rank can read
    it); a CUDA payload for several TP ranks is refused here. ``gpu_id``: the logical GPU a CPU rank
    stands for (marked on its buckets, so engines can check whose GPU a payload came from).
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
        exchange: Optional[PayloadExchange] = None,
        contributes: Sequence[tuple[int, int]] = (),
        gpu_id: Optional[str] = None,
    ) -> None:
        if not engines and not contributes:
            raise ValueError("no engines to send weights to")
        if exchange is None and (contributes or any(e.gathered for e in engines)):
            raise ValueError("payloads gathered over TP ranks need an exchange (the trainer world's store)")
        self.engines = list(engines)
        self.sglang_engines = sglang_engines
        self.exchange = exchange
        self.contributes = list(contributes)
        self.gpu_id = gpu_id
        self._sends = 0  # pushes so far: names this push's keys in the exchange
        self.bucket_bytes = bucket_bytes
        self.flattened = flattened
        self.timeout_s = timeout_s
        self._buffer: Optional[SharedBuffer] = None  # rayrl's own (engines that open them: connect())
        self._torch_buffer: Optional[torch.Tensor] = None  # torch's file-name sharing, for the others
        self._engine_buffers = False

    async def connect(self) -> None:
        """Ask the engines this rank posts to whether they open rayrl's own shared-memory buffers
        (rayrl/weights/shm.py: ``/get_server_info`` ``weight_buffers``); our CPU engine does. SGLang (and
        its strict stand-in) unpickle only torch's own handles, so they get torch's file-name sharing. A
        rank that only makes payloads for another rank to post (``contributes``) uses torch's too."""
        if not self.engines:
            return
        infos = await asyncio.gather(*(e.client.get_server_info() for e in self.engines))
        self._engine_buffers = all(info.get("weight_buffers") == WEIGHT_BUFFERS for info in infos)

    async def close(self) -> None:
        self._close_buffer()
        self._torch_buffer = None
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
            return (flatten_bucket(bucket, require_sglang=self.sglang_engines) if self.flattened
                    else [(n, t.detach()) for n, t in bucket])
        # on CPU: fill one shared-memory buffer, reused by every bucket (the engine has copied the previous
        # one before we get here), so pickling moves no bytes and no new pages are touched
        if self.flattened:
            if self._engine_buffers:  # rayrl's own buffer: it never outlives this process (shm.py)
                dtype, numel = torch.uint8, sum(t.numel() * t.element_size() for _, t in bucket)
                return flatten_bucket(bucket, out=self._cpu_buffer(numel).typed(dtype, numel),
                                      require_sglang=self.sglang_engines)
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            if self._torch_buffer is None or self._torch_buffer.numel() < nbytes:
                self._torch_buffer = shared_cpu_buffer(max(nbytes, self.bucket_bytes))
            return flatten_bucket(bucket, out=self._torch_buffer, require_sglang=self.sglang_engines)
        if self._engine_buffers:
            return self._cpu_buffer(SharedBuffer.packed_size([t for _, t in bucket])).pack(bucket)
        # CPU storages are moved into shared memory when pickled: share copies, not the trainer's params.
        return [(n, t.detach().clone()) for n, t in bucket]

    async def send(self, named_tensors: NamedTensors, version: str | int) -> TransferStats:
        version = str(version)
        stats = TransferStats(version)
        started = time.perf_counter()
        send_no, self._sends = self._sends, self._sends + 1
        buckets = iter_buckets(named_tensors, self.bucket_bytes)
        for index, (bucket, last) in enumerate(with_last(buckets)):
            on_gpu = bucket[0][1].is_cuda
            if on_gpu and any(e.tp_size > 1 and not e.gathered for e in self.engines):
                raise WeightTransferError(
                    "a CUDA IPC payload is made on one GPU; an engine with tp_size > 1 needs one per TP rank, made "
                    "by the trainer rank on that rank's GPU (rayrl/weights/plan.py plans them when the engine's "
                    "GPUs are the trainer's: colocated); use pipeline.weight_transfer=distributed otherwise"
                )
            obj = self._bucket_object(bucket)  # stays referenced until every engine has answered
            if isinstance(obj, dict) and not on_gpu and self.gpu_id is not None:
                obj[GPU_MARK] = self.gpu_id
            payload = serialize_for_engine(obj)
            for engine, tp_rank in self.contributes:  # another rank posts these: hand them over first
                self.exchange.offer(engine, send_no, index, tp_rank, payload, last)
            if self.engines:
                await self._post(index, payload, last, version, send_no)
            for engine, _ in self.contributes:  # the engine has copied (or refused) them
                await self.exchange.outcome(engine, send_no, index)
            del obj, payload
            if on_gpu:  # the engines have copied: give the bucket's memory back to the driver now, so a
                torch.cuda.ipc_collect()  # colocated engine's next bucket (or its KV cache) has room
            stats.add_bucket([t for _, t in bucket])
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        stats.seconds = time.perf_counter() - started
        if self.engines:
            await verify_version(self.engines, version)
        logger.info(
            "weights v%s handed to %d colocated engine(s)%s: %d tensors, %.1f MB in %d buckets, %.2f GB/s",
            version, len(self.engines), f" and {len(self.contributes)} TP rank(s) posted by another rank"
            if self.contributes else "", stats.tensors, stats.bytes / 1e6, stats.buckets, stats.gb_per_s,
        )  # fmt: skip
        return stats

    async def _post(self, index: int, payload: str, last: bool, version: str, send_no: int) -> None:
        """Bucket ``index`` to every engine this rank posts for: one request each, one entry per TP rank
        (the gathered engines' other entries from the ranks on their GPUs), then the answer to those ranks."""
        entries: list[list[str]] = []
        try:
            for e in self.engines:
                if e.gathered:
                    entries.append([payload, *await self.exchange.collect(e.exchange_key, send_no, index,
                                                                          e.tp_size, last)])
                else:
                    entries.append([payload] * e.tp_size)
        except WeightTransferError as err:  # the ranks waiting on this bucket learn why, then it fails here
            for e in self.engines:
                if e.gathered:
                    self.exchange.answer(e.exchange_key, send_no, index, str(err))
            raise
        results = await asyncio.gather(
            *(
                e.client.update_weights_from_serialized(
                    entry,
                    load_format="flattened_bucket" if self.flattened else None,
                    flush_cache=last,
                    weight_version=version if last else None,
                    timeout_s=self.timeout_s,
                )
                for e, entry in zip(self.engines, entries)
            ),
            return_exceptions=True,
        )
        try:
            check_results(results, self.engines, "update_weights_from_tensor")
        finally:
            for e, result in zip(self.engines, results):
                if e.gathered:
                    refused = isinstance(result, BaseException) or (isinstance(result, dict)
                                                                    and result.get("success") is False)
                    self.exchange.answer(e.exchange_key, send_no, index, _describe(result) if refused else None)


def _describe(result: Any) -> str:
    if isinstance(result, BaseException):
        return f"{type(result).__name__}: {result}"
    return f"refused: {result.get('message')}"
