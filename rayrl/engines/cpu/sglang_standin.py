"""A stand-in for SGLang 0.5.9 (the pinned version) on CPU: the CPU engine behind SGLang's own contract.

rayrl's CPU engine is lenient where SGLang is not, so a test that passes against it can still fail on a
GPU. ``python -m rayrl.engines.cpu --strict-sglang`` (``engine.extra_args: [--strict-sglang]``)
serves the same engine through :class:`StrictSGLangServer`, which runs the pinned wheel's own control code
where it imports on CPU (rayrl/engines/cpu/sglang_control.py) and enforces the rest as read in its source
(entrypoints/http_server.py, managers/tokenizer_manager.py, managers/tokenizer_communicator_mixin.py,
managers/scheduler.py, utils/common.py, model_executor/model_runner.py):

- every request is held to SGLang's route table (a path or method it does not serve: 404/405) and built
  into SGLang's own request class for that route (io_struct, with pydantic as its FastAPI routes do): a
  field it lacks, a wrong type or literal, a memory tag outside ``GPU_MEMORY_ALL_TYPES``, a dtype that
  ``getattr(torch, dtype)`` does not resolve, a sampling parameter ``SamplingParams`` refuses: 4xx,
  counted in ``contract_violations``. ``--record-requests DIR`` appends each request (bodies with tensor
  payloads shortened), its status and any refusal to a JSONL file there, which the tests check after a
  run (``sglang_control.check_recorded_requests``);
- release, resume, the weight updates and ``/flush_cache`` run SGLang's ``SchedulerUpdateWeightsMixin``
  itself on a scheduler object over the CPU engine (:class:`~rayrl.engines.cpu.sglang_control.CPUScheduler`):
  its memory tags (resuming a tag not released is a KeyError), its idle assertions (release with a
  request running; an update with ``flush_cache`` while one runs, as in an ``in_place`` pause). Whatever
  raises in that code kills SGLang's scheduler: here the request fails with 500 and so does every later
  one (``/server_info`` says why, in ``sglang_contract.scheduler_died``);
- weights released without ``--enable-weights-cpu-backup`` (SGLang's default) come back as NaN, and
  until every parameter has been loaded again each ``/generate`` fails with 500, counted in
  ``lost_weight_generations`` (on SGLang it would decode garbage, silently);
- ``/get_weight_version`` and ``/weight_version`` answer 404 (0.5.9: "use /model_info");
- ``/update_weights_from_tensor`` payloads are unpickled by SGLang's own ``MultiprocessingSerializer``
  (its ``SafeUnpickler``: only ``sglang.srt.*`` buckets, torch and Python's own types) and flattened
  buckets are cut apart by SGLang's own ``FlattenedTensorBucket``; on 0.5.9 a refused payload kills the
  scheduler, here it is answered 400 and counted in ``contract_violations``. One entry per TP rank
  (``--tp-size``), each deserialized on its own as its rank would, made on that rank's GPU
  (rayrl/weights/tp_payloads.py); too few entries, or one from another GPU, is refused the same way;
- every ``/generate`` holds the model-update reader lock for its whole run, and an update that arrives
  while generation is not paused takes the writer lock: it waits for the running generations, and new
  ones wait behind it (writer first). Paused (any mode), updates apply at once;
- ``/pause_generation`` in ``abort`` mode aborts everything and returns only once no generation holds
  the lock; requests that arrive while paused wait until ``/continue_generation``;
- responses carry no per-token policy versions (0.5.9 sends none);
- ``/load_lora_adapter_from_tensors``: ``serialized_tensors`` is unpickled by SGLang's own serializer, as
  its tp_worker does outside any error handling (a refused payload kills the scheduler: 400 here, counted),
  and must be the dict of tensors its LoRAAdapter iterates; ``config_dict`` must be one SGLang's own
  ``LoRAConfig`` reads (``r``, ``lora_alpha``, ``target_modules``).

And it counts what would be silently wrong on SGLang, in ``/get_server_info`` ``sglang_contract``:
``mixed_weight_generations`` (a generation admitted between two buckets of one update, so it ran on
half-updated weights) and ``unseen_version_spans`` (a generation that finished on other weights than it
started on, with nothing in its response to say so). The pipeline's tests assert all of them stay 0.

Not modelled: 0.5.5's ``mode``-less pause, and 0.5.21's ``/begin_weight_update`` session (not in 0.5.9).
The SGLang wheel must be importable (the test extra installs it without its GPU dependencies).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Optional

from aiohttp import web

from rayrl.engines.cpu.server import EngineServer
from rayrl.engines.cpu.sglang_control import (
    SGLangRefusal,
    load_sglang_control,
    make_scheduler,
    parse_sglang_request,
)
from rayrl.engines.http_input import RequestError, error_response, read_body, read_json
from rayrl.weights.group import WeightGroupError, parse_specs, receive_tensors
from rayrl.weights.tp_payloads import check_tp_entries, entry_gpu
from rayrl.weights.wire import WeightUpdateError

PINNED_SGLANG = "0.5.9"
INFO_PATHS = ("/server_info", "/get_server_info")
logger = logging.getLogger(__name__)


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

    def __init__(self, *args: Any, record_path: Optional[str] = None, weights_cpu_backup: bool = False,
                 **kwargs: Any) -> None:
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
        self.control = load_sglang_control()
        self.scheduler = make_scheduler(self.engine, self._is_no_request, weights_cpu_backup)
        self._scheduler_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-scheduler")
        self.scheduler_died: Optional[str] = None
        self.lock = ModelUpdateLock()
        self.counts: Counter = Counter()
        self.update_open = False  # a bucket without weight_version applied; the one that sets it closes it
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._record = None  # one JSONL file per engine process under the --record-requests directory
        if record_path:
            os.makedirs(record_path, exist_ok=True)
            self._record = open(os.path.join(record_path, f"requests-{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115

    async def stop(self) -> None:
        await super().stop()
        self._scheduler_thread.shutdown(wait=False)
        if self._record is not None:
            self._record.close()

    # -- every request: SGLang's route table and request classes, recorded ---------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        body: Any = None
        refusal: Optional[str] = None
        if self.scheduler_died is not None and request.path not in INFO_PATHS:
            response: web.StreamResponse = error_response(500, f"SGLang {PINNED_SGLANG}'s scheduler died: "
                                                               f"{self.scheduler_died}")
        else:
            try:
                raw = await read_body(request) if request.can_read_body else b""
                body = json.loads(raw) if raw else None
            except (RequestError, ValueError):
                body = None  # the handler answers it (400)
            try:
                request["sglang_req"] = parse_sglang_request(self.control, request.method, request.path, body)
            except SGLangRefusal as err:
                self.counts["contract_violations"] += 1
                refusal = str(err)
                logger.error("refused as SGLang %s would: %s", PINNED_SGLANG, err)
                response = error_response(err.status, refusal)
            else:
                response = await super()._middleware(request, handler)
        if self._record is not None:
            self._record.write(json.dumps({"t": round(time.time(), 3), "method": request.method,
                                           "path": request.path, "body": _shorten(body),
                                           "status": response.status, "refused": refusal,
                                           "scheduler_died": self.scheduler_died}) + "\n")
        return response

    def _is_no_request(self) -> bool:
        """The scheduler's ``_is_no_request``: nothing running; stricter, nothing waiting either (the CPU
        engine keeps a retracted request in its batch, where SGLang moves it to the waiting queue)."""
        stats = self.engine.stats()
        return not (stats["running"] or stats["waiting"] or self.lock.readers)

    async def _in_scheduler(self, fn: Callable, *args: Any) -> Any:
        """Run SGLang's scheduler code on the scheduler thread; whatever raises there kills the scheduler."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._scheduler_thread, fn, *args)
        except Exception as err:
            self.scheduler_died = f"{type(err).__name__}: {err}"
            self.counts["contract_violations"] += 1
            logger.error("SGLang %s's scheduler would die here (%s); every request now fails with 500",
                         PINNED_SGLANG, self.scheduler_died)
            reason = f"SGLang {PINNED_SGLANG}'s scheduler died: {self.scheduler_died}"
            raise web.HTTPInternalServerError(reason=" ".join(reason.split())[:400]) from None

    # -- generation: the reader lock, held for the whole request ------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        await self._unpaused.wait()  # 0.5.9's tokenizer manager holds new requests while paused
        async with self.lock.reader():
            if self.scheduler.lost:  # resumed without a CPU backup and not loaded since: garbage on SGLang
                self.counts["lost_weight_generations"] += 1
                lost = self.scheduler.lost_weights()
                return error_response(500, f"the weights were released without a CPU backup and {len(lost)} "
                                           f"parameters (e.g. {lost[0]}) were not loaded since they came back: "
                                           f"SGLang {PINNED_SGLANG} would generate from garbage")
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
                                   "unseen_version_spans": 0, "contract_violations": 0,
                                   "lost_weight_generations": 0, **self.counts,
                                   "scheduler_died": self.scheduler_died,
                                   "offload_tags": sorted(self.scheduler.offload_tags),
                                   "lost_weights": len(self.scheduler.lost),
                                   "weights_cpu_backup": self.scheduler.weights_cpu_backup}
        return web.json_response(info)

    # -- pause, release, resume, flush ---------------------------------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = request["sglang_req"].mode
        self._unpaused.clear()
        response = await super().pause_generation(request)
        if mode == "abort":  # 0.5.9 waits until no request holds the lock
            await self.lock.wait_unlocked()
        return response

    async def continue_generation(self, request: web.Request) -> web.Response:
        response = await super().continue_generation(request)
        self._unpaused.set()
        return response

    async def release_memory(self, request: web.Request) -> web.Response:
        await self._in_scheduler(self.scheduler.release_memory_occupation, request["sglang_req"])
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        await self._in_scheduler(self.scheduler.resume_memory_occupation, request["sglang_req"])
        return web.json_response(None)

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = await self._in_scheduler(self.scheduler.flush_cache)
        return web.Response(status=200 if ok else 400, text=(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"))

    # -- weight updates: the writer lock unless paused, then SGLang's scheduler mixin ----------------

    async def _locked_update(self, request: web.Request, handler: Any) -> web.Response:
        req = request["sglang_req"]
        if req.abort_all_requests:
            self.engine.abort_all()
        lock = contextlib.nullcontext() if self.engine.paused else self.lock.writer()
        async with lock:
            response = await handler(request)
        if response.status == 200:
            self.update_open = req.weight_version is None and request.path != "/update_weights_from_disk"
        return response

    async def _scheduler_update(self, method: Callable, req: Any) -> web.Response:
        out = await self._in_scheduler(method, req)
        return web.json_response({"success": out.success, "message": out.message},
                                 status=200 if out.success else 400)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        return await self._locked_update(request, lambda r: self._scheduler_update(
            self.scheduler.update_weights_from_disk, r["sglang_req"]))

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        req = request["sglang_req"]
        try:
            specs = parse_specs(req.names, req.dtypes, req.shapes)
            group = self.weight_groups.get(req.group_name)
        except WeightGroupError as err:
            raise RequestError(str(err)) from None

        def receive() -> list:
            import torch

            return receive_tensors(group, specs, torch.device("cpu"), flattened=req.load_format == "flattened_bucket")

        req.receive = receive
        return await self._locked_update(request, lambda r: self._scheduler_update(
            self.scheduler.update_weights_from_distributed, req))

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        return await self._locked_update(request, self._update_from_tensor)

    async def _update_from_tensor(self, request: web.Request) -> web.Response:
        """As 0.5.9's tp_worker/model_runner, once per TP rank: rank ``r`` deserializes entry ``r`` with
        SGLang's serializer and cuts a flattened bucket apart with SGLang's class; the weights load once
        every rank's entry was made on its GPU and all agree (rayrl/weights/tp_payloads.py)."""
        req = request["sglang_req"]
        load_format, entries = req.load_format, req.serialized_named_tensors
        if not entries:
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
        req.named_tensors = named
        return await self._scheduler_update(self.scheduler.update_weights_from_tensor, req)

    def _reconstruct(self, obj: Any) -> list:
        bucket = self._bucket_cls(flattened_tensor=obj["flattened_tensor"], metadata=[
            self._metadata_cls(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                               end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]])
        return bucket.reconstruct_tensors()

    # -- LoRA adapters -------------------------------------------------------------------------------

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        config = body.get("config_dict")
        if isinstance(config, dict):
            from sglang.srt.lora.lora_config import LoRAConfig  # type: ignore[import-not-found]

            try:  # 0.5.9's lora_manager reads it first; a missing key fails the load (no crash)
                LoRAConfig.from_dict(config, body.get("added_tokens_config"))
            except Exception as err:
                return web.json_response({"success": False, "error_message": f"{type(err).__name__}: {err}",
                                          "loaded_adapters": None}, status=400)
        return await super().load_lora_adapter_from_tensors(request)

    def _adapter_tensors(self, payload: Any) -> Any:
        """As 0.5.9's tp_worker: SGLang's own MultiprocessingSerializer (outside any try: its refusal kills
        the scheduler), then the LoRAAdapter iterates ``tensors.items()``."""
        try:
            obj = self._serializer.deserialize(payload)
        except Exception as err:
            return self._refuse(f"serialized_tensors: SGLang {PINNED_SGLANG} refuses this payload (its scheduler "
                                f"dies on it): {type(err).__name__}: {err}")
        if not isinstance(obj, dict):
            return self._refuse(f"serialized_tensors holds a {type(obj).__name__}; SGLang {PINNED_SGLANG}'s "
                                "LoRAAdapter iterates a dict of name -> tensor")
        return obj

    def _refuse(self, message: str) -> web.Response:
        """A payload SGLang would fail on: 400 here, counted in ``contract_violations``."""
        self.counts["contract_violations"] += 1
        return web.json_response({"success": False, "message": message}, status=400)


def _shorten(body: Any) -> Any:
    """The body as recorded: each tensor payload entry replaced by a string saying its length."""
    if isinstance(body, dict) and isinstance(body.get("serialized_named_tensors"), list):
        body = {**body, "serialized_named_tensors": [f"<{len(e)} chars>" if isinstance(e, str) else e
                                                     for e in body["serialized_named_tensors"]]}
    return body
