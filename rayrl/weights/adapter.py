"""The adapter transport: a LoRA policy's update is its adapter, through SGLang's own LoRA routes.

With ``trainer.lora`` the trainer sends only the adapter (megabytes, not the model): every engine this rank
feeds gets ``/load_lora_adapter_from_tensors`` (SGLang 0.5.9's request: ``lora_name``, ``config_dict`` =
adapter_config.json, ``serialized_tensors`` = its ``MultiprocessingSerializer`` form of a dict PEFT name ->
tensor), after ``/unload_lora_adapter`` of the previous one (SGLang refuses a name already loaded), then
``/update_weight_version``: tokens generated from then on carry the new version. Requests name the adapter
(:data:`rayrl.engines.api.LORA_ADAPTER`, the router's ``lora_path``).

The tensors travel as shared-memory file names (one buffer per update), which only a process on
the sender's node can open: rayrl/weights/plan.py gives this sender only engines on its own node and
refuses a layout with an engine no trainer rank shares a node with (``distributed``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping, Optional, Sequence

import torch

from rayrl.engines.api import LORA_ADAPTER
from rayrl.weights.transfer import (
    EngineTarget,
    NamedTensors,
    TransferStats,
    WeightTransferError,
    close_clients,
    verify_version,
)
from rayrl.weights.wire import serialize_adapter, shared_cpu_buffer

ALIGN = 64  # bytes: each tensor of the shared buffer starts aligned for any dtype


class AdapterSender:
    """Sends the adapter to ``engines`` (each on this rank's node) under ``name`` with ``config``."""

    def __init__(self, engines: Sequence[EngineTarget], config: Mapping[str, Any], *, name: str = LORA_ADAPTER,
                 timeout_s: float = 300.0) -> None:
        if not engines:
            raise ValueError("no engines to send the adapter to")
        self.engines = list(engines)
        self.config = dict(config)
        self.name = name
        self.timeout_s = timeout_s
        self._loaded: dict[str, bool] = {}  # engine URL -> it holds an adapter under ``name``
        self._buffer: Optional[torch.Tensor] = None

    async def connect(self) -> None:
        """Which engines hold the adapter already (a sender made again after an engine joined)."""
        found = await asyncio.gather(*(e.client.lora_adapters() for e in self.engines))
        self._loaded = {e.client.base_url: self.name in names for e, names in zip(self.engines, found)}

    def _shared(self, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The tensors copied into a new shared-memory buffer (views of it, by name). New at every update:
        SGLang's LoRAAdapter keeps the CPU tensors it was given (``.cpu()`` of a CPU tensor is itself), so
        the previous adapter's buffer must not change under it; the engine holds it as long as it needs."""
        sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, t in tensors]
        self._buffer = shared_cpu_buffer(sum(sizes))
        out, offset = {}, 0
        for (name, t), size in zip(tensors, sizes):
            nbytes = t.numel() * t.element_size()
            view = self._buffer[offset:offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t.detach())
            out[name] = view
            offset += size
        return out

    async def send(self, named_tensors: NamedTensors, version: str | int) -> TransferStats:
        version = str(version)
        stats = TransferStats(version)
        started = time.perf_counter()
        tensors = [(n, t.detach().cpu().contiguous()) for n, t in named_tensors]
        if not tensors:
            raise WeightTransferError("the trainer gave no adapter tensors to send")
        shared = self._shared(tensors)
        payload = serialize_adapter(shared)
        stats.add_bucket([t for _, t in tensors])
        await asyncio.gather(*(self._load(e, payload, version) for e in self.engines))
        await verify_version(self.engines, version)
        stats.seconds = time.perf_counter() - started
        return stats

    async def _load(self, engine: EngineTarget, payload: str, version: str) -> None:
        client = engine.client
        try:
            if self._loaded.get(client.base_url, False):
                await client.unload_lora_adapter(self.name)
                self._loaded[client.base_url] = False
            await client.load_lora_adapter_from_tensors(self.name, self.config, payload, timeout_s=self.timeout_s)
            self._loaded[client.base_url] = True
            await client.update_weight_version(version)
        except Exception as err:
            raise WeightTransferError(f"LoRA adapter update (version {version}) failed on {client.base_url}: "
                                      f"{err}") from err

    async def close(self) -> None:
        self._buffer = None
        await close_clients(self.engines)
