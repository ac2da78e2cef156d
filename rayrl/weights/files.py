"""Weights as safetensors files: what the disk transport writes and what ``/update_weights_from_disk`` reads.

The trainer writes a versioned safetensors directory to shared memory (/dev/shm when present) and each
engine on that node loads it with ``/update_weights_from_disk``: memory to memory, through the endpoint
SGLang uses for its disk fallback. Reading checks names and shapes from the headers before any bytes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rayrl.weights.owners import shared_memory_root
from rayrl.weights.wire import WeightUpdateError, check_names_and_shapes

__all__ = ["export_state_dict", "read_checkpoint", "safetensors_files", "shared_memory_root", "write_weights"]


def export_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's HF-named tensors, each storage once (tied embeddings are written once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous().cpu()
    return out


def write_weights(state: dict[str, torch.Tensor], root: Path, version: int) -> Path:
    """Write ``state`` as ``root/v{version}/model.safetensors`` atomically and remove every other version.

    Only the version just written is kept (not the highest number: after a resume, the version written
    can be lower than one left on disk by the run before).
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version:06d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".writing-"))
    save_file(state, str(tmp / "model.safetensors"), metadata={"weight_version": str(version)})
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in root.glob("v*"):
        if old.is_dir() and old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


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
