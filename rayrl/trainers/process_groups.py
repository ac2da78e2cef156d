"""The trainer ranks' torch.distributed world, and its NCCL memory given back while the engines hold the GPUs.

NCCL keeps buffers on the GPU for every communicator (WORLD, and on the Megatron backend each tensor,
pipeline, data and context-parallel group) for as long as its process group lives, whether or not it is
in use. In the colocated schedule the trainer lends its GPU to the engines between steps, so where the
backend is NCCL the trainer's groups are destroyed when it offloads and made again when it onloads, as
slime does around its trainer's sleep and wake (slime/utils/reloadable_process_group.py; read, not
copied). On gloo (CPU) there is no GPU memory to give back and nothing changes.

:class:`TrainerWorld` starts WORLD over a TCP store this rank keeps (rank 0 serves it; it outlives every
group, and the weight path's per-bucket handshake uses it too: rayrl/weights/tp_payloads.py). Where the
world is releasable it also wraps ``torch.distributed.new_group``, so every group made afterwards
(Megatron's parallel state, which its DDP wrapper, optimizer and layers keep) is a :class:`LiveGroup`
handle:

- :meth:`TrainerWorld.release`: every rank meets at the store, destroys WORLD (torch then shuts down
  every group's communicators) and stands up a gloo WORLD on the same store, so rank and size queries
  and CPU barriers keep working in between with nothing on the GPU; a collective on a handle fails,
  saying the groups are released;
- :meth:`TrainerWorld.remake`: the ranks meet again, the gloo WORLD goes, WORLD is made with NCCL under
  a new key prefix, and every recorded ``new_group`` call is made again in its original order (they are
  collective), so each handle points at a live group again.

torch finds groups in its own registry, which knows the live groups and not the handles, so the public
``torch.distributed`` functions that take a group (and ``P2POp``, ``_coalescing_manager``) are wrapped
to hand torch the live group. Groups made before :meth:`TrainerWorld.start` (none in rayrl) or through
torch's private helpers are not recorded: destroying WORLD ends them for good.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from rayrl.trainers.backend import TrainerBackend

logger = logging.getLogger(__name__)

WORLD_PREFIX = "rayrl-world"
# every rank reaches a release/remake within seconds of the others (the driver calls them together, on idle
# ranks); one still missing after this has died (its node lost), and the others raise instead of waiting
# the collective timeout (30 min): the driver's grace for these phases (actors/trainer.py) is longer
MEET_TIMEOUT_S = 45.0


class GroupsReleasedError(RuntimeError):
    """A collective on a trainer process group while the groups are released (the trainer is offloaded)."""


class RankMissingError(RuntimeError):
    """A release or remake of the process groups where some rank never came (it died)."""


class LiveGroup(dist.ProcessGroup):
    """A handle on a process group that survives the group being destroyed and made again."""

    def __init__(self, group: dist.ProcessGroup, description: str) -> None:
        super().__init__(group.rank(), group.size())
        self._group: Optional[dist.ProcessGroup] = group
        self._description = description
        self._left: Optional[str] = None  # why the rank left it for good (TrainerWorld.leave)

    @property
    def live(self) -> dist.ProcessGroup:
        if self._group is None:
            raise GroupsReleasedError(
                f"process group {self._description}: {self._left}" if self._left else
                f"process group {self._description} is released while the trainer is offloaded (colocated "
                "schedule); it is made again at onload"
            )
        return self._group

    def __getattr__(self, name: str) -> Any:  # what ProcessGroup itself does not define
        return getattr(self.live, name)

    def __repr__(self) -> str:
        state = "released" if self._group is None else "live"
        return f"LiveGroup({self._description}, {state})"


def _forwarder(name: str) -> Callable[..., Any]:
    def forward(self: LiveGroup, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.live, name)(*args, **kwargs)

    forward.__name__ = name
    return forward


# every method a ProcessGroup has acts on the live group (collectives, rank/size, names, backends, ...)
for _name in dir(dist.ProcessGroup):
    if not _name.startswith("__") and callable(getattr(dist.ProcessGroup, _name, None)) and _name[0].islower():
        setattr(LiveGroup, _name, _forwarder(_name))
for _name in ("_get_backend", "_get_backend_name", "_start_coalescing", "_end_coalescing", "_allgather_base",
              "_reduce_scatter_base", "_set_group_name", "_set_group_desc", "_has_hooks", "_id", "_device_types",
              "_get_sequence_number_for_group", "_wait_for_pending_works", "_register_on_completion_hook"):
    if hasattr(dist.ProcessGroup, _name):
        setattr(LiveGroup, _name, _forwarder(_name))


def _unwrap(value: Any) -> Any:
    return value.live if isinstance(value, LiveGroup) else value


def _unwrapping(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*(_unwrap(a) for a in args), **{k: _unwrap(v) for k, v in kwargs.items()})

    call.__rayrl_original__ = fn  # type: ignore[attr-defined]
    return call


class _Hooks:
    """The wrapped ``torch.distributed`` functions, installed once per process (they read the active world)."""

    installed = False
    originals: dict[str, Any] = {}

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        with warnings.catch_warnings():  # dir() reaches deprecated aliases (reduce_op), which warn when read
            warnings.simplefilter("ignore", FutureWarning)
            found = {name: fn for name in dir(dist) if inspect.isfunction(fn := getattr(dist, name))}
        for name, fn in found.items():
            if name.startswith("__") or name == "new_group":
                continue
            try:
                params = inspect.signature(fn).parameters
            except (TypeError, ValueError):
                continue
            if "group" in params or name == "_coalescing_manager":
                cls.originals[name] = fn
                setattr(dist, name, _unwrapping(fn))
        cls.originals["new_group"] = dist.new_group
        dist.new_group = _recording_new_group
        cls.originals["P2POp"] = dist.P2POp
        dist.P2POp = _LiveP2POp
        cls.installed = True

    @classmethod
    def original(cls, name: str) -> Any:
        return cls.originals.get(name, getattr(dist, name))


def _p2p_args(op: Any, group: Any) -> tuple[Any, Any]:
    return getattr(op, "__rayrl_original__", op), _unwrap(group)


class _LiveP2POp(dist.P2POp):
    """``P2POp`` taking a handle (and the wrapped isend/irecv), as Megatron's pipeline schedules build them."""

    def __new__(cls, op: Callable, tensor: torch.Tensor, peer: Optional[int] = None, group: Any = None,
                tag: int = 0, group_peer: Optional[int] = None) -> Any:
        op, group = _p2p_args(op, group)
        return super().__new__(cls, op, tensor, peer, group, tag, group_peer)

    def __init__(self, op: Callable, tensor: torch.Tensor, peer: Optional[int] = None, group: Any = None,
                 tag: int = 0, group_peer: Optional[int] = None) -> None:
        op, group = _p2p_args(op, group)
        super().__init__(op, tensor, peer, group, tag, group_peer)


_ACTIVE: Optional["TrainerWorld"] = None


def _recording_new_group(*args: Any, **kwargs: Any) -> Any:
    group = _Hooks.original("new_group")(*args, **kwargs)
    if _ACTIVE is None or not _ACTIVE.releasable:
        return group
    return _ACTIVE.record(args, kwargs, group)


class TrainerWorld:
    """This rank's torch.distributed world: WORLD over a kept TCP store, released and remade on NCCL."""

    def __init__(self, rank: int, world_size: int, backend: str, master_addr: str, master_port: int,
                 timeout_s: float = 1800.0, releasable: Optional[bool] = None,
                 meet_timeout_s: float = MEET_TIMEOUT_S) -> None:
        """``releasable``: destroy and remake the groups around offload/onload (default: on NCCL only; tests
        set it on gloo to exercise the mechanism on CPU). ``meet_timeout_s``: how long a release or remake
        waits for the other ranks."""
        self.meet_timeout_s = meet_timeout_s
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.master = (master_addr, master_port)
        self.timeout = timedelta(seconds=timeout_s)
        self.releasable = backend == "nccl" if releasable is None else releasable
        self.store: Any = None
        self.released = False
        self.generation = 0
        self.meetings = 0
        self._calls: list[tuple[tuple, dict, Any]] = []  # every new_group call since start, with its handle
        self.log: list[str] = []  # what happened, in order (tests read it)

    def start(self) -> "TrainerWorld":
        global _ACTIVE
        # torch._dynamo (imported by transformers) keeps references to the default group when it is imported
        # after the group exists, so destroying the group would not close its connections (leave() relies
        # on that): imported first, it keeps none
        import torch._dynamo  # noqa: F401

        addr, port = self.master
        self.store = dist.TCPStore(addr, port, self.world_size, self.rank == 0, timeout=self.timeout,
                                   wait_for_workers=False)
        if self.releasable:
            _Hooks.install()
            _ACTIVE = self
        self._make_world(self.backend)
        return self

    def _make_world(self, backend: str) -> None:
        self.generation += 1
        store = dist.PrefixStore(f"{WORLD_PREFIX}-{self.generation}-{backend}", self.store)
        _Hooks.original("init_process_group")(backend, store=store, rank=self.rank, world_size=self.world_size,
                                              timeout=self.timeout)
        self.log.append(f"world {backend}")

    def record(self, args: tuple, kwargs: dict, group: Any) -> Any:
        """Keep a ``new_group`` call to make again at :meth:`remake`; returns what the caller keeps."""
        handle = group
        if isinstance(group, dist.ProcessGroup):
            ranks = kwargs.get("ranks", args[0] if args else None)
            handle = LiveGroup(group, f"#{len(self._calls)} (ranks {ranks if ranks is not None else 'all'})")
        self._calls.append((args, kwargs, handle))
        return handle

    @property
    def groups(self) -> int:
        """How many groups were made through ``new_group`` (recorded; made again at each remake)."""
        return len(self._calls)

    def _meet(self, what: str) -> None:
        """Every rank reaches this point before any goes on (a barrier through the store, no group needed).
        Raises RankMissingError after ``meet_timeout_s`` (a rank that never comes has died)."""
        self.meetings += 1
        key = f"rayrl-meet/{what}/{self.meetings}"
        if self.store.add(key, 1) == self.world_size:
            self.store.set(key + "/all", "1")
        try:
            self.store.wait([key + "/all"], timedelta(seconds=self.meet_timeout_s))
        except Exception as err:  # DistStoreError (timeout), or the store's server (rank 0) is gone
            raise RankMissingError(f"rank {self.rank}: not every rank reached the {what} of the process groups "
                                   f"within {self.meet_timeout_s:g} s (a rank died?): {err}") from None

    def release(self) -> bool:
        """Destroy every group (their communicators' GPU memory goes); False where not releasable or already
        released."""
        if not self.releasable or self.released:
            return False
        started = time.monotonic()
        self._meet("release")
        for _, _, handle in self._calls:
            if isinstance(handle, LiveGroup):
                handle._group = None
        dist.destroy_process_group()  # WORLD: torch shuts down every group it made with it
        self._make_world("gloo")  # rank/size queries and CPU barriers keep working; no GPU memory
        self.released = True
        self.log.append("released")
        logger.info("rank %d: %d process groups and %s WORLD released in %.2f s", self.rank, len(self._calls),
                    self.backend, time.monotonic() - started)
        return True

    def remake(self) -> bool:
        """Make WORLD and every recorded group again, in the order they were made; False where nothing was
        released."""
        if not self.released:
            return False
        started = time.monotonic()
        self._meet("remake")
        dist.destroy_process_group()  # the gloo stand-in
        self._make_world(self.backend)
        original = _Hooks.original("new_group")
        for args, kwargs, handle in self._calls:
            group = original(*args, **kwargs)  # collective: every rank makes the same calls in the same order
            if isinstance(handle, LiveGroup):
                handle._group = group
        self.released = False
        self.log.append("remade")
        logger.info("rank %d: %s WORLD and %d process groups made again in %.2f s", self.rank, self.backend,
                    len(self._calls), time.monotonic() - started)
        return True

    def leave(self, reason: str) -> bool:
        """Leave every group at once, for good, after this rank failed in a step: its connections close, so a
        peer waiting on it inside a collective fails now instead of at the collective timeout (30 min). On
        gloo the peers raise within milliseconds (a peer of a dead rank can otherwise be left waiting on a
        live one that already gave up; tests/pipeline/test_trainer_failure.py); NCCL communicators are aborted,
        which frees this rank (its peers still rely on the driver's grace). The run stops on the failure, so
        nothing is made again; this rank keeps its state and can still write a checkpoint. Returns whether
        there was anything to leave."""
        if not dist.is_initialized():
            return False
        for _, _, handle in self._calls:
            if isinstance(handle, LiveGroup):
                handle._group, handle._left = None, f"left after a failed step ({reason})"
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if self.backend == "nccl" and abort is not None:
            abort()  # destroying a communicator that may still have work queued could wait on it
        else:
            dist.destroy_process_group()
        self.log.append("left")
        logger.info("rank %d: left its process groups after a failed step: %s", self.rank, reason)
        return True

    def close(self) -> None:
        global _ACTIVE
        if dist.is_initialized():
            dist.destroy_process_group()
        if _ACTIVE is self:
            _ACTIVE = None


def offload_rank(world: Optional[TrainerWorld], trainer: TrainerBackend) -> bool:
    """A trainer rank lends its GPU: its process groups first, then its memory (slime's sleep: destroy the
    groups, then pause the memory saver). Returns whether the trainer's memory moved."""
    if world is not None:
        world.release()
    return bool(trainer.offload())


def onload_rank(world: Optional[TrainerWorld], trainer: TrainerBackend) -> bool:
    """The rank takes its GPU back: its memory first, then its process groups (slime's wake-up order)."""
    moved = bool(trainer.onload())
    if world is not None:
        world.remake()
    return moved
