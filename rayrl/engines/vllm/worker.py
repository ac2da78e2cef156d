"""rayrl's weight-transfer engine for vLLM, registered through vLLM's own factory. Runs inside vLLM.

This module is imported by vLLM's workers, in vLLM's interpreter (``engine.vllm.python``), never by
rayrl's: the vllm backend starts vLLM with ``--worker-extension-cls
rayrl.engines.vllm.worker.RayrlWorkerExtension`` and ``--weight-transfer-config
'{"backend": "rayrl_shm"}'``, with rayrl's source on ``PYTHONPATH``. Importing the extension class is what
runs :func:`register` in each worker before its model loads (vllm/v1/worker/worker_base.py resolves the
extension at worker init; vllm/v1/worker/gpu_worker.py creates the configured transfer engine in
``load_model``), so the engine is there when vLLM's factory looks the backend up.

Why an engine of our own: vLLM 0.32's engines are NCCL, CUDA IPC and RDMA-based ones; none runs on CPU.
Ours takes the payloads rayrl's senders already make (rayrl/weights/handles.py: flattened buckets whose
bytes lie in rayrl's shared-memory buffers, rayrl/weights/shm.py) and reads them with the same
allow-listed unpickler our CPU engine uses (rayrl/weights/wire.py ``deserialize_entry``), so no tensor
bytes cross HTTP and no other pickled class is accepted. A safetensors directory (the disk transport)
loads the same way. The tensors go through vLLM's layerwise reload, as its own IPC engine does:
``start_weight_update`` puts the layers back in checkpoint form, each bucket goes through the model's
own ``load_weights`` (checkpoint names: q/k/v and gate/up fused as vLLM fuses them, tied heads skipped),
and a layer is processed for its kernels (on CPU, repacked) once all its weights are in;
``finish_weight_update`` finalizes the rest. A version's buckets are therefore one session: a layer
whose weights straddle two buckets is only complete after both (loading in place instead fails on CPU,
where processing replaced the parameters: ``'Parameter' object has no attribute 'weight_loader'``), and
the tensors are copied out of the sender's buffer first, since the reload holds a straddling layer's
tensors until its last weight arrives while the sender reuses one buffer for every bucket.

The control plane is vLLM's own: ``/start_weight_update``, ``/update_weights`` with this engine's
``update_info``, ``/finish_weight_update`` with the weight version (rayrl/engines/vllm/adapter.py calls
them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "rayrl_shm"  # the --weight-transfer-config backend name


@dataclass
class RayrlInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the buffers are files the worker opens by name."""


@dataclass
class RayrlUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: ``payload`` (one ``serialized_named_tensors`` entry as rayrl's senders make it) or
    ``safetensors_dir`` (a directory of ``*.safetensors`` files, the disk transport)."""

    payload: Optional[str] = None
    safetensors_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if (self.payload is None) == (self.safetensors_dir is None):
            raise ValueError("rayrl_shm update_info needs exactly one of payload or safetensors_dir")


class RayrlWeightTransferEngine(WeightTransferEngine[RayrlInitInfo, RayrlUpdateInfo]):
    """Loads rayrl's weight payloads into the worker's model, in place (see the module docstring)."""

    init_info_cls = RayrlInitInfo
    update_info_cls = RayrlUpdateInfo

    def init_transfer_engine(self, init_info: RayrlInitInfo) -> None:
        pass  # no process group, no buffers to allocate: each update names its own

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._reprocess_tied_head()

    def _reprocess_tied_head(self) -> None:
        """A head tied to the embedding gets no weights of its own (the checkpoint has none), so the
        reload never processes it again; on CPU its processing packed the old weights into the GEMM it
        runs (vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm``), which would go on
        computing logits with them. It is processed again over the embedding's new weights."""
        head = getattr(self.model, "lm_head", None)
        embed = getattr(getattr(self.model, "model", None), "embed_tokens", None)
        weight, shared = getattr(head, "weight", None), getattr(embed, "weight", None)
        if not isinstance(weight, torch.Tensor) or not isinstance(shared, torch.Tensor):
            return
        if weight.device.type == "meta" or weight.data_ptr() != shared.data_ptr():
            return  # not tied: the head had its own weights in the checkpoint and was processed with them
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)

    def receive_weights(self, update_info: RayrlUpdateInfo) -> None:
        if update_info.payload is not None:
            from rayrl.weights.wire import deserialize_entry

            # ValueError for anything not a weight payload; on GPU, CUDA IPC handles as SGLang's senders make them
            named, _gpu = deserialize_entry(update_info.payload, allow_cuda=self.device.type == "cuda")
            # copied out of the sender's buffer: layerwise reload keeps the tensors of a layer whose other
            # weights come in a later bucket, and the sender refills the same buffer with that bucket
            named = [(name, tensor.clone()) for name, tensor in named]
        else:
            named = _read_safetensors_dir(update_info.safetensors_dir or "")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():  # as vLLM's IPC engine loads: a bucket is part of a model
            self.model.load_weights(iter(named))  # a name the model does not have raises there

    def shutdown(self) -> None:
        pass


def _read_safetensors_dir(path: str) -> list[tuple[str, torch.Tensor]]:
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    out: list[tuple[str, torch.Tensor]] = []
    for f in files:
        out.extend(load_file(str(f)).items())
    return out


def register() -> None:
    """Add :class:`RayrlWeightTransferEngine` to vLLM's factory as ``rayrl_shm`` (once per process)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, RayrlWeightTransferEngine)


class RayrlWorkerExtension:
    """The class named by ``--worker-extension-cls``: importing it registers the engine in each worker.

    Its one method is reached through vLLM's ``/collective_rpc`` and serves tests: a parameter's values
    as the worker holds them (vLLM's fused name), to check that an update landed."""

    def rayrl_parameter(self, name: str, first: int = 8) -> list[float]:
        params = dict(self.model_runner.get_model().named_parameters())  # type: ignore[attr-defined]
        if name not in params:
            raise ValueError(f"no parameter {name!r}")
        return params[name].detach().reshape(-1)[:first].float().tolist()


register()
