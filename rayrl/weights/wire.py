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
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from rayrl.weights.shm import buffer_ref, open_buffer


class WeightUpdateError(ValueError):
    """A weight payload that does not fit the model (unknown names, wrong shapes, unreadable data)."""


def encode_named_tensors(named_tensors: Mapping[str, torch.Tensor]) -> str:
    """``base64(safetensors bytes)`` of CPU, contiguous copies of ``named_tensors``."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors.items()}
    return base64.b64encode(save_bytes(tensors)).decode("ascii")


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
# handle on GPU, a shared-memory file name on CPU: rayrl/weights/shm.py), never as bytes. Only
# same-machine senders can use it.
# The receiving side unpickles with an allow-list (as SGLang does since CVE-2025-10164): only torch's
# tensor-rebuild functions, torch value types and the bucket metadata class can be named.

SGLANG_METADATA_CLASS = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


@dataclass
class FlattenedTensorMetadata:
    """Where one tensor lies in a flattened bucket; the same fields as SGLang's class of this name."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flatten_bucket(
    named_tensors: Sequence[tuple[str, torch.Tensor]], out: Optional[torch.Tensor] = None
) -> dict[str, Any]:
    """SGLang's flattened bucket: one 1-D tensor (one dtype) plus the metadata to cut it apart again.

    ``out``: a 1-D buffer (at least as long) to write into instead of a new tensor, e.g. one already in
    shared memory that is reused bucket after bucket."""
    dtypes = {t.dtype for _, t in named_tensors}
    if len(dtypes) != 1:
        raise WeightUpdateError(f"a flattened bucket holds one dtype; got {sorted(map(str, dtypes))}")
    metadata, offset = [], 0
    for name, t in named_tensors:
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + t.numel(), t.numel()))
        offset += t.numel()
    parts = [t.detach().reshape(-1) for _, t in named_tensors]
    if out is None:
        return {"flattened_tensor": torch.cat(parts), "metadata": metadata}
    flat = out[:offset]
    torch.cat(parts, out=flat)
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten_bucket(bucket: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`flatten_bucket` (also reads buckets built by SGLang's own class)."""
    flat, metadata = bucket.get("flattened_tensor"), bucket.get("metadata")
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not isinstance(metadata, list):
        raise WeightUpdateError("a flattened bucket needs a 1-D flattened_tensor and a metadata list")
    out = []
    for m in metadata:
        if not isinstance(m, FlattenedTensorMetadata):
            raise WeightUpdateError("flattened bucket metadata entries must be FlattenedTensorMetadata")
        try:
            if not 0 <= m.start_idx <= m.end_idx <= flat.numel() or m.end_idx - m.start_idx != m.numel:
                raise WeightUpdateError(f"{m.name}: bucket slice [{m.start_idx}, {m.end_idx}) is out of range")
            out.append((m.name, flat[m.start_idx : m.end_idx].view(tuple(m.shape)).to(m.dtype)))
        except (TypeError, RuntimeError) as err:  # a shape that does not fit its slice, a non-dtype
            raise WeightUpdateError(f"{m.name}: bad bucket metadata: {err}") from None
    return out


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
    buf = io.BytesIO()
    with _cpu_tensors_by_file_name():
        _EnginePickler(buf).dump(obj)
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
_CUDA_GLOBALS = {(_REDUCTIONS, "rebuild_cuda_tensor"), ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")}
_METADATA_CLASSES = {SGLANG_METADATA_CLASS, (__name__, "FlattenedTensorMetadata")}


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allow_cuda: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.allow_cuda = allow_cuda

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _METADATA_CLASSES:
            return FlattenedTensorMetadata
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if key in _CUDA_GLOBALS:
            if not self.allow_cuda:
                raise WeightUpdateError(
                    "the payload holds CUDA IPC handles, which the CPU engine cannot open; send CPU tensors"
                )
            if key[0] == _REDUCTIONS:
                return super().find_class(module, name)
            raise WeightUpdateError("SGLang-patched CUDA handles need SGLang's receiver")
        if key == (_REDUCTIONS, "rebuild_storage_fd"):
            raise WeightUpdateError(
                "the sender shared CPU tensors by file descriptor, which only its child processes can open; "
                "use torch.multiprocessing's file_system sharing strategy (rayrl serialize_for_engine does)"
            )
        if key in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise WeightUpdateError(f"the payload names {module}.{name}, which is not allowed in a weight payload")


def deserialize_from_trainer(payload: Any, allow_cuda: bool = False) -> list[tuple[str, torch.Tensor]]:
    """One ``serialized_named_tensors`` entry -> ``[(name, tensor), ...]`` (flattened buckets are cut
    apart). Raises WeightUpdateError for anything that is not a weight payload; never runs other code."""
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
        return unflatten_bucket(obj)
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
    return out
