"""The engine server's weight routes, SGLang's API: from disk, from tensors (SGLang's serialized form),
and from a trainer's process group (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``), plus ``/update_weight_version``; and the CPU engine's own
``/set_weight_format`` (how its decode path holds the weights: the pipeline's float32 fallback).

A mixin of EngineServer (server.py), kept apart because weight transfer is its own concern: it uses the
server's ``engine``, ``weight_groups`` and ``weight_group_timeout_s``. What travels on the wire and how it
is checked lives in rayrl/weights/ (wire.py, group.py, files.py); this module is only HTTP.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

from aiohttp import web

from rayrl.engines.cpu.sampling import is_int
from rayrl.engines.http_input import RequestError, bool_flag, read_json
from rayrl.weights.group import WeightGroupError, parse_specs, receive_tensors
from rayrl.weights.tp_payloads import check_tp_entries
from rayrl.weights.wire import decode_named_tensors, deserialize_adapter, deserialize_entry

# SGLang 0.5.9's LoadLoRAAdapterFromTensorsReqInput / UnloadLoRAAdapterReqInput (and BaseReq's rid, http_worker_ipc)
LORA_LOAD_FIELDS = {"lora_name", "config_dict", "serialized_tensors", "pinned", "added_tokens_config", "lora_id", "rid",
                    "http_worker_ipc"}
LORA_UNLOAD_FIELDS = {"lora_name", "lora_id", "rid", "http_worker_ipc"}


class WeightEndpoints:
    """Weight routes of the engine server (mixed into EngineServer, which sets ``tp_size`` and ``tp_gpus``)."""

    tp_size: int = 1  # the tensor-parallel ranks this engine stands for (one entry each in a tensor update)
    tp_gpus: tuple[str, ...] = ()  # the (logical) GPU each rank reads, when placed on GPUs
    tp_payload_gpus: list[Optional[str]]  # the GPU each rank's entry of the last tensor update was marked with

    @staticmethod
    def _version_field(body: dict[str, Any], key: str = "weight_version") -> Optional[str]:
        value = body.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise RequestError(f"{key} must be a string")
        return str(value)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        version = self._version_field(body, "new_version")
        if version is None:
            raise RequestError("new_version is required")
        if bool_flag(body, "abort_all_requests"):
            self.engine.abort_all()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.set_weight_version, version)
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    async def set_weight_format(self, request: web.Request) -> web.Response:
        """``{"weight_format": "float32" | "fp16-packed"}``: repack the decode weights between steps."""
        body = await read_json(request)
        fmt = body.get("weight_format")
        if not isinstance(fmt, str):
            raise RequestError("weight_format must be a string")
        previous = self.engine.weight_format
        seconds = await asyncio.get_running_loop().run_in_executor(None, self.engine.set_weight_format, fmt)
        return web.json_response({"success": True, "message": f"Decode weights are {fmt}.", "weight_format": fmt,
                                  "previous_weight_format": previous, "pack_seconds": seconds})

    async def _apply_weights(self, body: dict[str, Any], load: Callable[[], int], what: str) -> web.Response:
        version = self._version_field(body)
        if bool_flag(body, "abort_all_requests"):
            self.engine.abort_all()
        try:
            count = await asyncio.get_running_loop().run_in_executor(None, load)
        except (ValueError, OSError) as err:  # WeightUpdateError is a ValueError
            return web.json_response(
                {"success": False, "message": f"Failed to update weights: {err}", "num_paused_requests": 0},
                status=400,
            )
        message = f"Succeeded to update model weights ({count} tensors {what})."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise RequestError("model_path must be a non-empty string")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise RequestError(
                "load_format: the CPU engine reads safetensors checkpoints only (null, auto, safetensors)"
            )
        version = self._version_field(body)
        return await self._apply_weights(
            body, lambda: self.engine.load_weights_from_disk(path, version), f"from {path}"
        )

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's payload (``load_format`` null, "direct" or "flattened_bucket": shared-memory handles,
        unpickled with an allow-list) or the byte-carrying ``"safetensors"`` form (entry 0, for every rank).

        SGLang's form has one entry per tensor-parallel rank, and rank ``r`` deserializes entry ``r``: this
        engine, one process standing for ``tp_size`` ranks, deserializes each entry as its rank would and
        loads the weights once they agree (rayrl/weights/tp_payloads.py: entry ``r`` made on rank ``r``'s
        GPU, every entry the same weights)."""
        body = await read_json(request)
        load_format = body.get("load_format")
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries or not all(isinstance(e, str) for e in entries):
            raise RequestError("serialized_named_tensors must be a non-empty list of base64 strings")
        version = self._version_field(body)
        if load_format == "safetensors":

            def load() -> int:
                return self.engine.update_weights(decode_named_tensors(entries[0]), version)

            return await self._apply_weights(body, load, "from the request")
        if load_format not in (None, "direct", "flattened_bucket"):
            raise RequestError(
                f"load_format {load_format!r} is not supported by the CPU engine "
                '(null, "direct", "flattened_bucket" or "safetensors")'
            )
        if len(entries) != self.tp_size:
            raise RequestError(
                f"serialized_named_tensors has {len(entries)} entries and this engine has tp_size {self.tp_size}: "
                "one per tensor-parallel rank, entry r read by rank r (SGLang's rank r indexes entry r)"
            )
        device = getattr(self.engine, "device", None)
        on_gpu = getattr(device, "type", "cpu") == "cuda"  # CUDA IPC handles
        try:
            per_rank = [deserialize_entry(entry, allow_cuda=on_gpu) for entry in entries]
        except ValueError as err:  # WeightUpdateError: not a payload, disallowed names, CUDA handles on CPU
            raise RequestError(
                f"{err} (SGLang's form: base64 of a multiprocessing pickle of [(name, tensor)] or a "
                'flattened bucket; bytes from another machine: load_format="safetensors")'
            ) from None
        try:
            named = check_tp_entries(per_rank, self.tp_gpus, device if on_gpu else None)
        except ValueError as err:
            raise RequestError(str(err)) from None
        tensors = dict(named)
        if len(tensors) != len(named):
            raise RequestError("serialized_named_tensors names a tensor twice")
        self.tp_payload_gpus = [gpu for _, gpu in per_rank]
        return await self._apply_weights(
            body, lambda: self.engine.update_weights(tensors, version), "from the request"
        )

    # -- LoRA adapters (SGLang's routes; the CPU engine merges the one it serves: engine_adapter.py) ----

    def _lora_result(self, error: Optional[str] = None) -> web.Response:
        """SGLang's LoRAUpdateOutput: 200 on success, 400 with ``error_message`` otherwise."""
        adapter = self.engine.adapter
        loaded = {adapter.name: {"lora_name": adapter.name, "lora_path": "__tensor__"}} if adapter else {}
        return web.json_response({"success": error is None, "error_message": error, "loaded_adapters": loaded},
                                 status=200 if error is None else 400)

    @staticmethod
    def _lora_body(body: dict[str, Any], fields: set[str]) -> str:
        unknown = sorted(set(body) - fields)
        if unknown:
            raise RequestError(f"unknown field(s) {', '.join(unknown)}")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise RequestError("lora_name must be a non-empty string")
        return name

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        """``{"lora_name", "config_dict", "serialized_tensors"}``: the adapter (PEFT's names and
        adapter_config.json) merged into the weights; the weight version is the caller's to set."""
        body = await read_json(request)
        name = self._lora_body(body, LORA_LOAD_FIELDS)
        config = body.get("config_dict")
        if not isinstance(config, dict):
            raise RequestError("config_dict must be an object (adapter_config.json)")
        if body.get("added_tokens_config"):
            return self._lora_result("LoRA serving currently doesn't support adapters that add tokens to the "
                                     "vocabulary")
        tensors = self._adapter_tensors(body.get("serialized_tensors"))
        if isinstance(tensors, web.Response):
            return tensors
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.load_adapter, name, config, tensors)
        except ValueError as err:  # AdapterError, WeightUpdateError
            return self._lora_result(str(err))
        return self._lora_result()

    def _adapter_tensors(self, payload: Any) -> dict[str, Any] | web.Response:
        """``serialized_tensors`` as {PEFT name: tensor} (rayrl's allow-listed unpickler; the strict SGLang
        stand-in uses SGLang's own)."""
        try:
            return deserialize_adapter(payload)
        except ValueError as err:
            raise RequestError(str(err)) from None

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        name = self._lora_body(body, LORA_UNLOAD_FIELDS)
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.unload_adapter, name)
        except ValueError as err:
            return self._lora_result(str(err))
        return self._lora_result()

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Join the trainer's weight broadcast group as rank ``rank_offset`` (one TP rank on CPU).

        Blocks until every rank has joined (the trainer joins as rank 0 while this call is open)."""
        body = await read_json(request)
        address, port = body.get("master_address"), body.get("master_port")
        offset, world = body.get("rank_offset"), body.get("world_size")
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        if not isinstance(address, str) or not address:
            raise RequestError("master_address must be a non-empty string")
        for key, value in (("master_port", port), ("rank_offset", offset), ("world_size", world)):
            if not is_int(value):
                raise RequestError(f"{key} must be an integer")
        if not 0 < port < 65536:
            raise RequestError("master_port must be in 1..65535")
        if not 1 <= offset < world:
            raise RequestError(f"rank_offset must be in 1..world_size-1 (the trainer is rank 0), got {offset}")
        if not isinstance(name, str) or not name:
            raise RequestError("group_name must be a non-empty string")
        if backend != "gloo":
            raise RequestError(f"backend {backend!r}: the CPU engine joins weight update groups over gloo only")
        try:
            await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: self.weight_groups.create(
                    master_address=address,
                    master_port=port,
                    rank=offset,
                    world_size=world,
                    group_name=name,
                    backend=backend,
                    timeout_s=self.weight_group_timeout_s,
                ),
            )
        except WeightGroupError as err:
            return web.json_response({"success": False, "message": str(err)}, status=400)
        return web.json_response(
            {"success": True, "message": f"Succeeded to initialize weight update group {name}."}
        )

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str):
            raise RequestError("group_name must be a string")
        try:
            self.weight_groups.destroy(name)
        except WeightGroupError as err:
            return web.json_response({"success": False, "message": str(err)}, status=400)
        return web.json_response({"success": True, "message": f"Destroyed weight update group {name}."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Receive the listed tensors by broadcast from the trainer (rank 0), in list order, and load them."""
        body = await read_json(request)
        load_format = body.get("load_format")
        if load_format not in (None, "flattened_bucket"):
            raise RequestError('load_format must be null or "flattened_bucket"')
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str):
            raise RequestError("group_name must be a string")
        try:
            specs = parse_specs(body.get("names"), body.get("dtypes"), body.get("shapes"))
            if load_format == "flattened_bucket" and len({s.dtype for s in specs}) > 1:
                raise WeightGroupError("a flattened bucket holds one dtype")
            group = self.weight_groups.get(name)
        except WeightGroupError as err:
            raise RequestError(str(err)) from None
        if len({s.name for s in specs}) != len(specs):
            raise RequestError("names lists a tensor twice")
        version = self._version_field(body)
        flattened = load_format == "flattened_bucket"

        def load() -> int:
            import torch

            try:
                named = receive_tensors(group, specs, torch.device("cpu"), flattened=flattened)
            except RuntimeError as err:  # the trainer went away or timed out mid-broadcast
                raise WeightGroupError(f"broadcast over {name!r} failed: {err}") from None
            return self.engine.update_weights(dict(named), version)

        return await self._apply_weights(body, load, f"from group {name}")
