"""The process group that carries weights from a trainer to engines (``/init_weights_update_group``).

The trainer is rank 0; engine ``i``'s tensor-parallel rank ``r`` joins as ``rank_offset_i + r``. The
group is created the way SGLang creates it on the engine side: a TCP rendezvous at the trainer's
``master_address:master_port``, a store prefixed with ``group_name``, and torch's own group constructor
with an identity rank map. Matching SGLang's recipe exactly matters: the store keys through which the
ranks find each other (and NCCL exchanges its unique id) must agree on both sides, so the trainer code
here also talks to a real SGLang server. The group is *not* the process's default group, so a trainer
rank that already belongs to its training world can join it as well.

On CPU the backend is gloo; on GPU the same code runs with ``backend="nccl"``.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")

# Every process in a weight group uses NCCL the same way, as SGLang's engines do: NCCL_ENV
# (rayrl/engines/backends/sglang.py), which the trainer ranks set too (actors/trainer.py).


class WeightGroupError(ValueError):
    """A weight-update group request that cannot be honoured (unknown group, bad spec, failed rendezvous)."""


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> ``torch.bfloat16``, as SGLang resolves ``dtypes``."""
    short = name[len("torch.") :] if isinstance(name, str) and name.startswith("torch.") else name
    value = getattr(torch, short, None) if isinstance(short, str) else None
    if not isinstance(value, torch.dtype):
        raise WeightGroupError(f"unknown dtype {name!r}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the wire form of ``dtypes``)."""
    return str(dtype).removeprefix("torch.")


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> Any:
    """A new (non-default) process group over a TCP rendezvous; blocks until every rank has joined."""
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if backend not in BACKENDS:
        raise WeightGroupError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # torch renamed pg_options -> backend_options (2.6); pass neither, only what both spellings share.
    params = inspect.signature(_new_process_group_helper).parameters
    kwargs: dict[str, Any] = {"group_name": group_name, "timeout": timeout}
    if "pg_options" in params:
        kwargs["pg_options"] = None
    result = _new_process_group_helper(world_size, rank, [], backend, store, **kwargs)
    group = result[0] if isinstance(result, tuple) else result
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_group(group: Any) -> None:
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError, AssertionError, KeyError):
        pass  # already gone, or torch refused a non-default group it never registered: nothing to free


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an ``/update_weights_from_distributed`` call."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def parse_specs(names: Any, dtypes: Any, shapes: Any) -> list[TensorSpec]:
    """Validate the ``names``/``dtypes``/``shapes`` lists of a request; raise WeightGroupError."""
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise WeightGroupError("names must be a non-empty list of parameter names")
    if not isinstance(dtypes, list) or len(dtypes) != len(names):
        raise WeightGroupError(f"dtypes must be a list with one entry per name ({len(names)})")
    if not isinstance(shapes, list) or len(shapes) != len(names):
        raise WeightGroupError(f"shapes must be a list with one entry per name ({len(names)})")
    specs = []
    for name, dt, shape in zip(names, dtypes, shapes):
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise WeightGroupError(f"{name}: shape must be a list of non-negative integers, got {shape!r}")
        specs.append(TensorSpec(name, dtype_from_name(dt), tuple(shape)))
    return specs


def receive_tensors(
    group: Any, specs: Sequence[TensorSpec], device: torch.device, flattened: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """The receiving side of :func:`broadcast_tensors`: fresh tensors filled by broadcasts from rank 0.

    ``flattened`` (SGLang's ``load_format="flattened_bucket"``): one 1-D tensor holding every tensor's
    bytes back to back, in one dtype; it is cut and reshaped here.
    """
    if flattened:
        dtypes = {s.dtype for s in specs}
        if len(dtypes) != 1:
            raise WeightGroupError("a flattened bucket holds one dtype; got " + ", ".join(map(str, dtypes)))
        flat = torch.empty(sum(s.numel for s in specs), dtype=dtypes.pop(), device=device)
        dist.broadcast(flat, src=0, group=group)
        out, offset = [], 0
        for s in specs:
            out.append((s.name, flat[offset : offset + s.numel].view(s.shape)))
            offset += s.numel
        return out
    out = []
    for s in specs:
        t = torch.empty(s.shape, dtype=s.dtype, device=device)
        dist.broadcast(t, src=0, group=group)
        out.append((s.name, t))
    return out


def broadcast_tensors(group: Any, tensors: Iterable[torch.Tensor], flattened: bool = False) -> None:
    """Rank 0's side: broadcast ``tensors`` in order (or their concatenation when ``flattened``)."""
    tensors = [t.detach().contiguous() for t in tensors]
    if flattened:
        dist.broadcast(torch.cat([t.reshape(-1) for t in tensors]), src=0, group=group)
        return
    for t in tensors:
        dist.broadcast(t, src=0, group=group)


class WeightGroups:
    """The engine side's named groups (one per trainer that connected), safe to use from worker threads."""

    def __init__(self) -> None:
        self._groups: dict[str, Any] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def create(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        with self._lock:
            if group_name in self._groups:
                raise WeightGroupError(f"the weight update group {group_name!r} already exists")
        try:
            group = init_custom_process_group(
                backend, master_address, master_port, rank, world_size, group_name, timeout_s
            )
        except WeightGroupError:
            raise
        except Exception as err:  # rendezvous timeouts, refused connections, backend errors
            raise WeightGroupError(f"could not join {group_name!r}: {type(err).__name__}: {err}") from None
        with self._lock:
            self._groups[group_name] = group

    def get(self, group_name: str) -> Any:
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise WeightGroupError(
                f"no weight update group named {group_name!r}; call /init_weights_update_group first"
            )
        return group

    def destroy(self, group_name: str) -> None:
        with self._lock:
            group = self._groups.pop(group_name, None)
        if group is None:
            raise WeightGroupError(f"no weight update group named {group_name!r}")
        destroy_group(group)

    def destroy_all(self) -> None:
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            destroy_group(group)

