"""The engine interface, written down: SGLang's native HTTP API as every backend serves it.

:data:`ROUTES` is what rayrl calls on an engine (path -> HTTP method); the pinned SGLang serves every one
(tests/contracts/test_sglang_contract.py reads them from its source) and so does our CPU engine
(rayrl/engines/cpu/server.py). A backend may add routes of its own (``EngineBackend.extra_routes``,
rayrl/engines/backends/); callers reach those only where the backend says it has them. :class:`EngineAPI` is
the same interface as Python calls, which ``EngineClient`` implements and everything above it (the
router, the weight senders, the fleet's control calls) is written against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    from rayrl.engines.client import GenerateOutput

ROUTES: dict[str, str] = {
    "/generate": "POST",  # input_ids, sampling_params, rid, return_logprob[, logprob_start_len]
    "/abort_request": "POST",  # rid | abort_all
    "/health": "GET",
    "/model_info": "GET",  # carries weight_version
    "/server_info": "GET",
    "/update_weights_from_disk": "POST",
    "/update_weights_from_tensor": "POST",  # serialized_named_tensors: one payload per TP rank
    "/init_weights_update_group": "POST",
    "/update_weights_from_distributed": "POST",
    "/destroy_weights_update_group": "POST",
    "/update_weight_version": "POST",
    "/pause_generation": "POST",  # mode: abort | in_place | retract
    "/continue_generation": "POST",
    "/flush_cache": "POST",
    "/release_memory_occupation": "POST",  # tags: weights | kv_cache | cuda_graph (None: all)
    "/resume_memory_occupation": "POST",
    "/load_lora_adapter_from_tensors": "POST",  # lora_name, config_dict, serialized_tensors (trainer.lora)
    "/unload_lora_adapter": "POST",  # lora_name
    "/v1/models": "GET",  # the base model and the LoRA adapters loaded (cards with a parent)
}

LORA_ADAPTER = "policy"  # the name the policy's LoRA adapter is loaded and requested under (trainer.lora)

# SGLang's memory regions (/release_memory_occupation's tags): every engine that serves the route checks a
# request's tags with check_memory_tags, so an unknown tag is a 400 everywhere and never a silent no-op
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def check_memory_tags(tags: Any, error: type[ValueError] = ValueError) -> list[str]:
    """``tags`` as a list of known tag names (None: all of them); ``error`` names what is wrong otherwise."""
    if tags is None:
        return list(MEMORY_TAGS)
    if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
        raise error("tags must be null or a list of strings")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise error(f"unknown memory tag(s) {unknown}; valid: {', '.join(MEMORY_TAGS)}")
    return list(tags)


class EngineAPI(Protocol):
    """One engine, as callers see it (``EngineClient``); each method is one call of :data:`ROUTES`."""

    base_url: str

    async def generate(self, input_ids: Sequence[int] | np.ndarray, sampling_params: Optional[Mapping[str, Any]] = None,
                       rid: Optional[str] = None, return_logprob: bool = True,
                       lora_path: Optional[str] = None) -> "GenerateOutput":
        """``/generate``: tokens, their log-probs and the weight version(s) that produced them (``lora_path``:
        generated with that LoRA adapter)."""
        ...

    async def prompt_logprobs(self, input_ids: Sequence[int] | np.ndarray, start: int) -> np.ndarray:
        """``/generate`` with no new tokens: the log-probs of ``input_ids[start:]``."""
        ...

    async def abort(self, rid: str) -> None:
        """``/abort_request`` for one request."""
        ...

    async def abort_all(self) -> None:
        """``/abort_request`` for every request."""
        ...

    async def health(self, timeout_s: float = 10.0) -> bool:
        """``/health`` answered 200."""
        ...

    async def get_model_info(self) -> dict[str, Any]:
        """``/model_info``."""
        ...

    async def get_server_info(self) -> dict[str, Any]:
        """``/server_info`` (``weight_buffers``: which weight buffers the engine opens)."""
        ...

    async def get_weight_version(self) -> str:
        """The weight version, from ``/model_info``."""
        ...

    async def update_weights_from_disk(self, path: str, weight_version: Optional[str] = None, *,
                                       abort_all_requests: bool = False) -> dict[str, Any]:
        """``/update_weights_from_disk``."""
        ...

    async def update_weights_from_serialized(self, serialized_named_tensors: Sequence[str], *,
                                             load_format: Optional[str] = None, flush_cache: bool = True,
                                             weight_version: Optional[str] = None, abort_all_requests: bool = False,
                                             timeout_s: Optional[float] = None) -> dict[str, Any]:
        """``/update_weights_from_tensor`` in SGLang's form: one serialized payload per TP rank."""
        ...

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl", timeout_s: Optional[float] = None) -> dict[str, Any]:
        """``/init_weights_update_group``: join the trainer's broadcast group."""
        ...

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], *,
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              weight_version: Optional[str] = None, load_format: Optional[str] = None,
                                              timeout_s: Optional[float] = None) -> dict[str, Any]:
        """``/update_weights_from_distributed``: announce one broadcast bucket."""
        ...

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        """``/destroy_weights_update_group``."""
        ...

    async def update_weight_version(self, new_version: str) -> dict[str, Any]:
        """``/update_weight_version``."""
        ...

    async def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: Mapping[str, Any],
                                             serialized_tensors: str,
                                             timeout_s: Optional[float] = None) -> dict[str, Any]:
        """``/load_lora_adapter_from_tensors``: load a LoRA adapter under ``lora_name``."""
        ...

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """``/unload_lora_adapter``."""
        ...

    async def lora_adapters(self) -> list[str]:
        """The LoRA adapters loaded, from ``/v1/models``."""
        ...

    async def set_weight_format(self, weight_format: str) -> dict[str, Any]:
        """``/set_weight_format``: an extra route (the CPU engine's; ``EngineBackend.switch_weight_format``)."""
        ...

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """``/pause_generation``."""
        ...

    async def continue_generation(self) -> dict[str, Any]:
        """``/continue_generation``."""
        ...

    async def flush_cache(self) -> str:
        """``/flush_cache``."""
        ...

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.2) -> float:
        """``/flush_cache`` polled until it answers 200 (the engine holds no request); the seconds waited."""
        ...

    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """``/release_memory_occupation``."""
        ...

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """``/resume_memory_occupation``."""
        ...

    async def close(self) -> None:
        """Close the HTTP session (no route)."""
        ...
