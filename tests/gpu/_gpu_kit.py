"""Helpers for tests/gpu (imported by path: pytest puts this directory on sys.path)."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import pytest


def need(*modules: str) -> None:
    """Skip (naming the package) unless every module imports."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any import failure means the stack is not usable here
            pytest.skip(f"{name} is not importable here: {type(err).__name__}: {err}")


def record(name: str, figures: dict[str, Any]) -> None:
    """Print the figures and write them to $OUT/<name>.json when $OUT is set."""
    line = json.dumps(figures, sort_keys=True)
    print(f"[{name}] {line}", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")


def gpu_memory_used_bytes(device: int | None = None) -> int:
    """Memory in use on the device as the driver sees it (what a paused region gives back shows here;
    ``torch.cuda.memory_allocated`` does not change on pause)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)
