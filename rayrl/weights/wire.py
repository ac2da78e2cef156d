"""The wire format of weights between a trainer and an engine: payloads, buckets, and the receiving checks.

``/update_weights_from_tensor`` accepts two payload forms. SGLang's own (``load_format`` null, "direct"
or "flattened_bucket"): each entry of ``serialized_named_tensors`` is base64 of a multiprocessing pickle
whose tensors travel as shared-memory handles; it is unpickled with an allow-list, so a payload can only
rebuild tensors. And a byte-carrying form (``load_format="safetensors"``): base64 of
``safetensors.torch.save(tensors)``, for senders on another machine. Whatever the form, the receiving
engine checks names and shapes against its model before copying anything (:func:`copy_into`).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from rayrl.engines.api import EngineAPI
from rayrl.weights.shm import buffer_ref, open_buffer


class WeightUpdateError(ValueError):
    """A weight payload that does not fit the model (unknown names, wrong shapes, unreadable data)."""


def encode_named_tensors(named_tensors: Mapping[str, torch.Tensor]) -> str:
    """``base64(safetensors bytes)`` of CPU, contiguous copies of ``named_tensors``."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors.items()}
    return base64.b64encode(save_bytes(tensors)).decode("ascii")


async def push_safetensors(engine: EngineAPI, named_tensors: Mapping[str, torch.Tensor],
                           weight_version: Optional[str] = None, *, flush_cache: bool = True,
                           abort_all_requests: bool = False) -> dict[str, Any]:
    """Load ``named_tensors`` into ``engine`` in one request, their bytes in it (``load_format="safetensors"``).

    For a notebook or a test that holds a few tensors; a run's trainer sends through the senders of
    rayrl/weights/transfer.py (buckets, every TP rank, the version reported once the last bucket is in).
    """
    return await engine.update_weights_from_serialized(
        [encode_named_tensors(named_tensors)], load_format="safetensors", flush_cache=flush_cache,
        weight_version=weight_version, abort_all_requests=abort_all_requests)


def decode_named_tensors(payload: str | bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_named_tensors`; raises WeightUpdateError on malformed data."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError) as err:
        raise WeightUpdateError(f"serialized_named_tensors[0] is not valid base64: {err}") from None
    try:
        return load_bytes(raw)
    except Exception as err:  # safetensors raises its own error types for bad headers
        raise WeightUpdateError(f"serialized_named_tensors[0] is not a safetensors payload: {err}") from None


def check_names_and_shapes(
    shapes: Mapping[str, tuple[int, ...]], targets: Mapping[str, torch.Tensor], source: str = "payload"
) -> None:
    """Raise WeightUpdateError naming unknown parameters or mismatched shapes (nothing is copied)."""
    if not shapes:
        raise WeightUpdateError(f"{source}: no tensors")
    unknown = [n for n in shapes if n not in targets]
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise WeightUpdateError(f"{source}: {len(unknown)} name(s) are not parameters of the model: {shown}")
    wrong = [
        f"{n}: got {list(s)}, the model has {list(targets[n].shape)}"
        for n, s in shapes.items()
        if tuple(s) != tuple(targets[n].shape)
    ]
    if wrong:
        raise WeightUpdateError(f"{source}: shape mismatch: " + "; ".join(wrong[:5]))


def copy_into(named_tensors: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]) -> int:
    """Copy (casting dtype) each tensor into the same-named model tensor; returns how many were copied."""
    for name, tensor in named_tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    check_names_and_shapes({n: tuple(t.shape) for n, t in named_tensors.items()}, targets)
    with torch.no_grad():
        for name, tensor in named_tensors.items():
            targets[name].copy_(tensor)
    return len(named_tensors)


# ---------------------------------------------------------------------------------------------------
# SGLang's serialized_named_tensors form (/update_weights_from_tensor with load_format null, "direct"
# or "flattened_bucket"): base64 of a multiprocessing pickle whose tensors travel as handles (a CUDA IPC
# handle on GPU, a shared-memory file name on CPU), never as bytes; on CPU a rayrl SharedBuffer goes by its
# own name, which never outlives its owner
# (rayrl/weights/shm.py; only engines that say they open them get one). Only same-machine senders can use it.
# SGLang unpickles it with its SafeUnpickler (CVE-2025-10164), which admits only torch, Python's own
# types and a few ``sglang.srt.*`` modules; a bucket's metadata must be SGLang's own
# ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` (any other class is refused, and on
# 0.5.9 the refusal kills the scheduler). So buckets are built with SGLang's own classes whenever SGLang
# is importable (always on the GPU path: the gpu extra installs it), and with :mod:`rayrl.weights.bucket`
# (the same byte layout, for a CPU-only install that talks to our CPU engine) otherwise.


SGLANG_METADATA_CLASS = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
GPU_MARK = "gpu_id"  # a CPU bucket's logical GPU (rayrl/weights/tp_payloads.py); SGLang ignores the key


def bucket_classes(require_sglang: bool = False) -> tuple[Any, Any]:
    """``(FlattenedTensorBucket, FlattenedTensorMetadata)``: SGLang's own when importable, else ours.

    ``require_sglang``: raise WeightUpdateError instead of falling back (a payload for SGLang must
    carry SGLang's classes: its unpickler refuses any other)."""
    try:
        from sglang.srt.weight_sync import tensor_bucket  # type: ignore[import-not-found]

        return tensor_bucket.FlattenedTensorBucket, tensor_bucket.FlattenedTensorMetadata
    except ImportError as err:
        if require_sglang:
            raise WeightUpdateError(
                "weights for an SGLang engine are buckets of SGLang's own classes "
                f"(sglang.srt.weight_sync.tensor_bucket), and sglang cannot be imported here: {err}. "
                "Install the gpu extra (pip install 'rayrl[gpu]') in the trainer's environment"
            ) from None
    from rayrl.weights import bucket

    return bucket.FlattenedTensorBucket, bucket.FlattenedTensorMetadata


def flatten_bucket(
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    out: Optional[torch.Tensor] = None,
    *,
    require_sglang: bool = False,
) -> dict[str, Any]:
    """A flattened bucket as ``/update_weights_from_tensor`` takes it: ``{"flattened_tensor": 1-D uint8
    tensor, "metadata": [FlattenedTensorMetadata]}``, every tensor's bytes back to back (any dtypes),
    exactly as SGLang's ``FlattenedTensorBucket(named_tensors=...)`` lays them out.

    ``out``: a 1-D uint8 buffer (at least as long) to write into instead of a new tensor, e.g. one already
    in shared memory that is reused bucket after bucket."""
    bucket_cls, metadata_cls = bucket_classes(require_sglang)
    if out is None:
        made = bucket_cls(named_tensors=list(named_tensors))
        return {"flattened_tensor": made.get_flattened_tensor(), "metadata": made.get_metadata()}
    if out.dtype != torch.uint8 or out.dim() != 1:
        raise WeightUpdateError("a bucket buffer is a 1-D uint8 tensor")
    metadata, offset = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        out[offset : offset + nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
        metadata.append(metadata_cls(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                                     end_idx=offset + nbytes, numel=nbytes))
        offset += nbytes
    return {"flattened_tensor": out[:offset], "metadata": metadata}


def unflatten_bucket(bucket: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`flatten_bucket`, checked: the slices must lie in the tensor and fit their shapes."""
    flat, metadata = bucket.get("flattened_tensor"), bucket.get("metadata")
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not isinstance(metadata, list):
        raise WeightUpdateError("a flattened bucket needs a 1-D flattened_tensor and a metadata list")
    allowed = tuple({bucket_classes()[1], _own_metadata_class()})
    out = []
    for m in metadata:
        if not isinstance(m, allowed):
            raise WeightUpdateError("flattened bucket metadata entries must be FlattenedTensorMetadata")
        try:
            if not 0 <= m.start_idx <= m.end_idx <= flat.numel() or m.end_idx - m.start_idx != m.numel:
                raise WeightUpdateError(f"{m.name}: bucket slice [{m.start_idx}, {m.end_idx}) is out of range")
            out.append((m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(tuple(m.shape))))
        except (TypeError, RuntimeError) as err:  # a shape that does not fit its slice, a non-dtype
            raise WeightUpdateError(f"{m.name}: bad bucket metadata: {err}") from None
    return out


def _sglang_cuda_rebuild() -> Any:
    """SGLang's patched CUDA tensor rebuild (the device named by UUID, so an engine with another
    CUDA_VISIBLE_DEVICES opens the right GPU); a payload made by SGLang's serializer names it."""
    try:
        from sglang.srt.utils import patch_torch  # type: ignore[import-not-found]
    except ImportError as err:
        raise WeightUpdateError(
            f"the payload was made by SGLang's serializer and sglang cannot be imported here: {err}"
        ) from None
    patch_torch.monkey_patch_torch_reductions()
    return patch_torch._rebuild_cuda_tensor_modified


def _own_metadata_class() -> Any:
    from rayrl.weights.bucket import FlattenedTensorMetadata

    return FlattenedTensorMetadata


@contextmanager
def _cpu_tensors_by_file_name() -> Iterator[None]:
    """Share CPU storages through named shared-memory files while pickling.

    torch's default (file descriptors) hands fds over a socket authenticated by the *parent's* key,
    which an unrelated engine process cannot open; a file name it can.
    """
    import torch.multiprocessing as mp

    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(previous)


def shared_cpu_buffer(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 CPU tensor in named shared memory: pickling it later hands out its name without a copy."""
    with _cpu_tensors_by_file_name():
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


class _EnginePickler(ForkingPickler):
    """torch's reductions, except that a tensor in a rayrl SharedBuffer travels as the buffer's name
    (rayrl/weights/shm.py): no torch_<pid>_* file, nothing left behind if the sender is killed."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            ref = buffer_ref(obj)
            if ref is not None:
                return open_buffer, ref
        return NotImplemented


def _first_tensor(obj: Any) -> torch.Tensor:
    if isinstance(obj, dict):
        return obj["flattened_tensor"]
    return obj[0][1]


def serialize_for_engine(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` for ``obj`` (a list of
    ``(name, tensor)`` or a flattened bucket). The caller keeps the tensors alive until the engine has
    answered. On GPU, SGLang's own serializer is used when importable: it names devices by UUID, so an
    engine with a different CUDA_VISIBLE_DEVICES opens the right GPU. CPU tensors go by shared-memory
    file name: a rayrl SharedBuffer's own (what HandleSender sends), any other tensor torch's
    (see :func:`_cpu_tensors_by_file_name`)."""
    if _first_tensor(obj).is_cuda:
        try:
            from sglang.srt.utils import MultiprocessingSerializer  # type: ignore[import-not-found]
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # type: ignore[import-not-found]

            monkey_patch_torch_reductions()
            return MultiprocessingSerializer.serialize(obj, output_str=True)
        except ImportError:
            pass
    from torch.multiprocessing import reductions

    buf = io.BytesIO()
    pickler = _EnginePickler(buf)  # a SharedBuffer's tensors by the buffer's name; the rest as torch does
    # SGLang's monkey_patch_torch_reductions (applied once a CUDA payload was made or received in this
    # process) replaces torch's tensor reducer process-wide with one that only handles CUDA tensors
    reduce_tensor = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    pickler.dispatch_table[torch.Tensor] = reduce_tensor
    pickler.dispatch_table[torch.nn.Parameter] = reduce_tensor
    with _cpu_tensors_by_file_name():
        pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED_GLOBALS = {
    (_REDUCTIONS, "rebuild_tensor"),
    (_REDUCTIONS, "rebuild_typed_storage"),
    (_REDUCTIONS, "rebuild_storage_filename"),
    (_REDUCTIONS, "rebuild_storage_empty"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("collections", "OrderedDict"),
    ("rayrl.weights.shm", "open_buffer"),  # a rayrl SharedBuffer by name (checks the name itself)
}
_SGLANG_CUDA_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")
_CUDA_GLOBALS = {(_REDUCTIONS, "rebuild_cuda_tensor"), _SGLANG_CUDA_REBUILD}
_OWN_METADATA_CLASS = ("rayrl.weights.bucket", "FlattenedTensorMetadata")


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allow_cuda: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.allow_cuda = allow_cuda

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key == SGLANG_METADATA_CLASS:
            return bucket_classes()[1]  # SGLang's own class when importable (its reconstruction reads it)
        if key == _OWN_METADATA_CLASS:
            return _own_metadata_class()
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if key in _CUDA_GLOBALS:
            if not self.allow_cuda:
                raise WeightUpdateError(
                    "the payload holds CUDA IPC handles, which the CPU engine cannot open; send CPU tensors"
                )
            if key == _SGLANG_CUDA_REBUILD:  # SGLang's serializer names the GPU by UUID: its rebuild maps it
                return _sglang_cuda_rebuild()
            return super().find_class(module, name)
        if key == (_REDUCTIONS, "rebuild_storage_fd"):
            raise WeightUpdateError(
                "the sender shared CPU tensors by file descriptor, which only its child processes can open; "
                "use torch.multiprocessing's file_system sharing strategy (rayrl serialize_for_engine does)"
            )
        if key in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise WeightUpdateError(f"the payload names {module}.{name}, which is not allowed in a weight payload")


def deserialize_entry(payload: Any, allow_cuda: bool = False) -> tuple[list[tuple[str, torch.Tensor]], Optional[str]]:
    """One ``serialized_named_tensors`` entry -> ``[(name, tensor), ...]`` (flattened buckets are cut
    apart), and the logical GPU a flattened bucket is marked with (or None: rayrl/weights/tp_payloads.py).
    Raises WeightUpdateError for anything that is not a weight payload; never runs other code."""
    if isinstance(payload, str):
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as err:
            raise WeightUpdateError(f"serialized_named_tensors entry is not valid base64: {err}") from None
    elif isinstance(payload, (bytes, bytearray)):
        raw = bytes(payload)
    else:
        raise WeightUpdateError("serialized_named_tensors entries must be base64 strings")
    try:
        obj = _AllowListUnpickler(raw, allow_cuda).load()
    except WeightUpdateError:
        raise
    except Exception as err:  # truncated pickles, shared-memory files already gone, ...
        raise WeightUpdateError(
            f"serialized_named_tensors entry is not a weight payload: {type(err).__name__}: {err}"
        ) from None
    if isinstance(obj, dict):
        gpu = obj.get(GPU_MARK)
        if gpu is not None and not isinstance(gpu, str):
            raise WeightUpdateError("a flattened bucket's gpu_id must be a string")
        return unflatten_bucket(obj), gpu
    if not isinstance(obj, (list, tuple)) or not obj:
        raise WeightUpdateError("a weight payload is a non-empty list of (name, tensor) or a flattened bucket")
    out = []
    for item in obj:
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], torch.Tensor)
        ):
            raise WeightUpdateError("each entry of a weight payload must be a (name, tensor) pair")
        out.append((item[0], item[1]))
    return out, None


def deserialize_adapter(payload: Any) -> dict[str, torch.Tensor]:
    """SGLang's ``/load_lora_adapter_from_tensors`` ``serialized_tensors`` -> {PEFT name: tensor}: the same
    allow-listed unpickling as a weight payload (CPU handles only), of a dict of tensors."""
    if not isinstance(payload, str):
        raise WeightUpdateError("serialized_tensors must be a base64 string")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise WeightUpdateError(f"serialized_tensors is not valid base64: {err}") from None
    try:
        obj = _AllowListUnpickler(raw, False).load()
    except WeightUpdateError:
        raise
    except Exception as err:  # truncated pickles, shared-memory files already gone, ...
        raise WeightUpdateError(f"serialized_tensors is not a tensor payload: {type(err).__name__}: {err}") from None
    if not isinstance(obj, dict) or not obj or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise WeightUpdateError("serialized_tensors must hold a non-empty dict of name -> tensor")
    return obj


def serialize_adapter(tensors: dict[str, torch.Tensor]) -> str:
    """``MultiprocessingSerializer.serialize(tensors, output_str=True)`` as SGLang's own
    ``Engine.load_lora_adapter_from_tensors`` makes it, for CPU tensors (torch's shared-memory file
    names: the caller keeps them alive until the engines have answered)."""
    from torch.multiprocessing import reductions

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    reduce_tensor = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    pickler.dispatch_table[torch.Tensor] = reduce_tensor
    pickler.dispatch_table[torch.nn.Parameter] = reduce_tensor
    with _cpu_tensors_by_file_name():
        pickler.dump(dict(tensors))
    return base64.b64encode(buf.getvalue()).decode("ascii")
