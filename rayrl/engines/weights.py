"""Weight payloads for the CPU engine: safetensors in, validated, copied into the live model.

The CPU form of ``/update_weights_from_tensor`` carries ``base64(safetensors.torch.save(tensors))``:
safetensors holds raw tensor bytes and a JSON header, so decoding never runs code (SGLang's GPU form
pickles CUDA IPC handles, which a CPU engine cannot use and should not unpickle).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes


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


def safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return [p]
    if not p.is_dir():
        raise WeightUpdateError(f"{path}: no such checkpoint directory or .safetensors file")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"{path}: the directory holds no .safetensors files")
    return files


def read_checkpoint(path: str | Path, targets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Read every tensor of a safetensors checkpoint after checking names and shapes from the headers.

    Checking the headers first means a wrong checkpoint fails before hundreds of MB are read.
    """
    files = safetensors_files(path)
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        check_names_and_shapes(shapes, targets, source=str(f))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                out[name] = handle.get_tensor(name)
    return out


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
