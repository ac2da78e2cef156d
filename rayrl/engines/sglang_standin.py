"""A stand-in for SGLang 0.5.9 (the pinned version) on CPU: the CPU engine behind SGLang's own contract.

rayrl's CPU engine is lenient where SGLang is not, so a test that passes against it can still fail on a
GPU. ``python -m rayrl.engines.cpu_server --strict-sglang`` (``engine.extra_args: [--strict-sglang]``)
serves the same engine through :class:`StrictSGLangServer`, which enforces what SGLang 0.5.9 enforces
(read in its source: entrypoints/http_server.py, managers/tokenizer_manager.py,
managers/tokenizer_communicator_mixin.py, managers/scheduler_update_weights_mixin.py,
utils/common.py, model_executor/model_runner.py):

- ``/get_weight_version`` and ``/weight_version`` answer 404 (0.5.9: "use /model_info"); the version is
  read from ``/model_info`` or ``/get_model_info``;
- ``/update_weights_from_tensor`` payloads are unpickled by SGLang's own ``MultiprocessingSerializer``
  (its ``SafeUnpickler``: only ``sglang.srt.*`` buckets, torch and Python's own types) and flattened
  buckets are cut apart by SGLang's own ``FlattenedTensorBucket``; on 0.5.9 a refused payload kills the
  scheduler, here it is answered 400 and counted in ``contract_violations``. One entry per TP rank
  (``--tp-size``), each deserialized on its own as its rank would, made on that rank's GPU
  (rayrl/weights/tp_payloads.py); too few entries, or one from another GPU, is refused the same way
  (0.5.9: an IndexError or an unknown GPU kills the scheduler; a GPU it sees but does not use is mapped
  silently, at the cost of a CUDA context and copies across GPUs);
- every ``/generate`` holds the model-update reader lock for its whole run, and an update that arrives
  while generation is not paused takes the writer lock: it waits for the running generations, and new
  ones wait behind it (writer first). Paused (any mode), updates apply at once;
- ``/pause_generation`` in ``abort`` mode aborts everything and returns only once no generation holds
  the lock; requests that arrive while paused wait until ``/continue_generation``;
- ``/release_memory_occupation`` with a generation running or waiting is refused (0.5.9 asserts and the
  scheduler dies), counted in ``contract_violations``;
- responses carry no per-token policy versions (0.5.9 sends none).

And it counts what would be silently wrong on SGLang, in ``/get_server_info`` ``sglang_contract``:
``mixed_weight_generations`` (a generation admitted between two buckets of one update, so it ran on
half-updated weights) and ``unseen_version_spans`` (a generation that finished on other weights than it
started on, with nothing in its response to say so). The pipeline's tests assert both stay 0.

Not modelled: 0.5.5's ``mode``-less pause, and 0.5.21's ``/begin_weight_update`` session (not in 0.5.9).
The SGLang wheel must be importable (the test extra installs it without its GPU dependencies).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from typing import Any, AsyncIterator

from aiohttp import web

from rayrl.engines.http_input import RequestError, read_json
from rayrl.engines.server import EngineServer
from rayrl.weights.tp_payloads import check_tp_entries, entry_gpu
from rayrl.weights.wire import WeightUpdateError

PINNED_SGLANG = "0.5.9"


class ModelUpdateLock:
    """SGLang's reader/writer lock (utils/aio_rwlock.py): many readers or one writer; a waiting writer
    holds new readers back."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        self.writer_active = False
        self.writers_waiting = 0

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer_active and self.writers_waiting == 0)
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        async with self._cond:
            self.writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self.writer_active and self.readers == 0)
            finally:
                self.writers_waiting -= 1
            self.writer_active = True
        try:
            yield
        finally:
            async with self._cond:
                self.writer_active = False
                self._cond.notify_all()

    async def wait_unlocked(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer_active and self.readers == 0)


class StrictSGLangServer(EngineServer):
    """EngineServer enforcing SGLang 0.5.9's contract (see the module docstring). A stand-in for tests."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from sglang.srt.utils import MultiprocessingSerializer  # type: ignore[import-not-found]
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # type: ignore[import-not-found]
        from sglang.srt.weight_sync.tensor_bucket import (  # type: ignore[import-not-found]
            FlattenedTensorBucket,
            FlattenedTensorMetadata,
        )

        super().__init__(*args, **kwargs)
        monkey_patch_torch_reductions()  # as 0.5.9's tp_worker: CUDA handles name their GPU by UUID
        self._serializer = MultiprocessingSerializer
        self._bucket_cls, self._metadata_cls = FlattenedTensorBucket, FlattenedTensorMetadata
        self.lock = ModelUpdateLock()
        self.counts: Counter = Counter()
        self.update_open = False  # a bucket without weight_version applied; the one that sets it closes it
        self._unpaused = asyncio.Event()
        self._unpaused.set()

    # -- generation: the reader lock, held for the whole request ------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        await self._unpaused.wait()  # 0.5.9's tokenizer manager holds new requests while paused
        async with self.lock.reader():
            if self.update_open:  # between two buckets of one update: half the weights are new
                self.counts["mixed_weight_generations"] += 1
            return await super().generate(request)

    def _result_json(self, res: Any, item: Any, text_in_lps: bool) -> dict[str, Any]:
        body = super()._result_json(res, item, text_in_lps)
        if res.token_versions is not None:  # the weights changed while it decoded (the CPU engine knows);
            self.counts["unseen_version_spans"] += 1  # 0.5.9 reports one version per response, never per token
            body["meta_info"].pop("output_token_versions", None)
        return body

    async def get_weight_version(self, request: web.Request) -> web.Response:
        raise web.HTTPNotFound(
            text='{"detail":"Endpoint \'/get_weight_version\' or \'/weight_version\' is deprecated. '
            'Please use \'/model_info\' instead."}',
            content_type="application/json",
        )

    async def server_info(self, request: web.Request) -> web.Response:
        response = await super().server_info(request)
        info = json.loads(response.body)
        info.pop("weight_buffers", None)  # SGLang unpickles torch's own handles only: no rayrl buffers
        info["sglang_contract"] = {"version": PINNED_SGLANG, "mixed_weight_generations": 0,
                                   "unseen_version_spans": 0, "contract_violations": 0, **self.counts}
        return web.json_response(info)

    # -- pause, release ------------------------------------------------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        self._unpaused.clear()
        response = await super().pause_generation(request)
        if (body.get("mode") or "abort") == "abort":  # 0.5.9 waits until no request holds the lock
            await self.lock.wait_unlocked()
        return response

    async def continue_generation(self, request: web.Request) -> web.Response:
        response = await super().continue_generation(request)
        self._unpaused.set()
        return response

    async def release_memory(self, request: web.Request) -> web.Response:
        stats = self.engine.stats()
        if stats["running"] or stats["waiting"] or self.lock.readers:
            self.counts["contract_violations"] += 1
            raise RequestError("release_memory_occupation should be called only when no ongoing request "
                               f"(SGLang {PINNED_SGLANG} asserts this in its scheduler, which then dies)")
        return await super().release_memory(request)

    # -- weight updates: the writer lock unless paused ----------------------------------------------

    async def _locked_update(self, request: web.Request, handler: Any) -> web.Response:
        body = await read_json(request)
        lock = contextlib.nullcontext() if self.engine.paused else self.lock.writer()
        async with lock:
            response = await handler(request)
        if response.status == 200:
            self.update_open = body.get("weight_version") is None and request.path != "/update_weights_from_disk"
        return response

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        return await self._locked_update(request, super().update_weights_from_disk)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        return await self._locked_update(request, super().update_weights_from_distributed)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        return await self._locked_update(request, self._update_from_tensor)

    async def _update_from_tensor(self, request: web.Request) -> web.Response:
        """As 0.5.9's tp_worker/model_runner, once per TP rank: rank ``r`` deserializes entry ``r`` with
        SGLang's serializer and cuts a flattened bucket apart with SGLang's class; the weights load once
        every rank's entry was made on its GPU and all agree (rayrl/weights/tp_payloads.py)."""
        body = await read_json(request)
        load_format = body.get("load_format")
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            raise RequestError("serialized_named_tensors must be a non-empty list")
        if load_format not in (None, "direct", "flattened_bucket"):
            raise RequestError(f"load_format {load_format!r}: the stand-in loads null, direct or flattened_bucket")
        if len(entries) != self.tp_size:  # 0.5.9: rank r indexes entry r; too few is an IndexError that kills
            return self._refuse(f"serialized_named_tensors has {len(entries)} entries for tp_size {self.tp_size}: "
                                "one per TP rank (too few: an IndexError in a rank kills the scheduler; too many: "
                                "the rest are never read, so they were meant for another engine)")
        per_rank = []
        for rank, entry in enumerate(entries):
            try:
                obj = self._serializer.deserialize(entry)
            except Exception as err:  # SafeUnpickler's RuntimeError: 0.5.9's scheduler dies on it
                return self._refuse(f"entry {rank}: SGLang {PINNED_SGLANG} refuses this payload (its scheduler dies "
                                    f"on it): {type(err).__name__}: {err}")
            named = self._reconstruct(obj) if load_format == "flattened_bucket" else list(obj)
            per_rank.append((named, entry_gpu(obj)))
        device = self.engine.device if self.engine.device.type == "cuda" else None
        try:
            named = check_tp_entries(per_rank, self.tp_gpus, device)
        except WeightUpdateError as err:
            return self._refuse(str(err))
        self.tp_payload_gpus = [gpu for _, gpu in per_rank]
        version = self._version_field(body)
        return await self._apply_weights(body, lambda: self.engine.update_weights(dict(named), version),
                                         "from the request")

    def _reconstruct(self, obj: Any) -> list:
        bucket = self._bucket_cls(flattened_tensor=obj["flattened_tensor"], metadata=[
            self._metadata_cls(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                               end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]])
        return bucket.reconstruct_tensors()

    def _refuse(self, message: str) -> web.Response:
        """A payload SGLang would fail on: 400 here, counted in ``contract_violations``."""
        self.counts["contract_violations"] += 1
        return web.json_response({"success": False, "message": message}, status=400)
