"""What every weight sender shares: the interface, the engines it targets, buckets and the version check.

A sender moves one trainer rank's weights to a set of engines over one transport (rayrl/weights/disk.py,
handles.py, broadcast.py). All three have the same three calls, so the trainer never asks which one it
holds:

- ``await connect()``: get ready (a broadcast group forms; the others have nothing to do);
- ``await send(named_tensors, version)``: every ``(hf_name, tensor)`` pair from any iterator (the torch
  trainer's ``named_weights``, or mbridge's export on the Megatron backend, which every rank must drain),
  in buckets of ``bucket_bytes``; the engines report ``version`` only once the last bucket is in, so a
  sample is never tagged with weights that were half loaded; returns :class:`TransferStats`;
- ``await close()``: leave what ``connect`` made (engines that are gone are skipped).

Generation should be paused around ``send`` where the schedule needs it (rayrl/orchestration/schedules.py decides).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Protocol, Sequence

import torch

from rayrl.engines.api import EngineAPI

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024  # slime/verl send 0.5-1 GB buckets; memory cost is one bucket

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightTransferError(RuntimeError):
    """An engine refused a bucket or the transfer failed; the engines may hold a mix of versions."""


@dataclass
class EngineTarget:
    """One engine server: its client and how many tensor-parallel ranks it has (each needs a payload or a
    seat in a broadcast group). ``exchange_key``: where the other TP ranks' payloads for it meet
    (rayrl/weights/tp_payloads.py), when trainer ranks on its other GPUs make them; None: one payload for
    every rank."""

    client: EngineAPI  # EngineClient: the engine interface (rayrl/engines/api.py)
    tp_size: int = 1
    exchange_key: Optional[int] = None

    @property
    def gathered(self) -> bool:
        return self.exchange_key is not None


@dataclass
class TransferStats:
    """One ``send``: how much moved, how fast."""

    version: str
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0

    def add_bucket(self, tensors: Sequence[torch.Tensor]) -> None:
        self.buckets += 1
        self.tensors += len(tensors)
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "seconds": self.seconds, "buckets": self.buckets, "gb_per_s": self.gb_per_s}


class WeightSender(Protocol):
    """The interface of every transport (see the module docstring)."""

    async def connect(self) -> None: ...

    async def send(self, named_tensors: NamedTensors, version: str | int) -> TransferStats: ...

    async def close(self) -> None: ...


def iter_buckets(
    named_tensors: NamedTensors, bucket_bytes: int, one_dtype: bool = False
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger tensor travels alone).

    ``one_dtype`` also closes a bucket when the dtype changes (a flattened broadcast is one tensor of one
    dtype; a flattened tensor bucket holds any dtypes as bytes).
    The input is consumed lazily, so at most one bucket is held at a time.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        dtype_change = one_dtype and bucket and bucket[-1][1].dtype != tensor.dtype
        if bucket and (size + nbytes > bucket_bytes or dtype_change):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def with_last(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """``(item, is_last)`` with one item of look-ahead."""
    try:
        current = next(items)
    except StopIteration:
        return
    for following in items:
        yield current, False
        current = following
    yield current, True


def check_results(results: Sequence[Any], engines: Sequence[EngineTarget], what: str) -> None:
    """Raise WeightTransferError for the first engine that failed or answered ``success: false``."""
    for engine, result in zip(engines, results):
        if isinstance(result, BaseException):
            raise WeightTransferError(f"{what} failed on {engine.client.base_url}: {result}") from result
        if isinstance(result, dict) and result.get("success") is False:
            raise WeightTransferError(f"{what} refused by {engine.client.base_url}: {result.get('message')}")


async def verify_version(engines: Sequence[EngineTarget], version: str) -> None:
    """Every engine must report ``version`` now (a half-applied update must not pass silently)."""
    seen = await asyncio.gather(*(e.client.get_weight_version() for e in engines))
    wrong = [(e.client.base_url, v) for e, v in zip(engines, seen) if v != version]
    if wrong:
        raise WeightTransferError(f"engines report another weight version than {version!r}: {wrong}")


async def close_clients(engines: Sequence[EngineTarget]) -> None:
    for engine in engines:
        await engine.client.close()
