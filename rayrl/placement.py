"""Placement plans: which GPU bundles the trainer ranks and the engines use, and on CPU how many
cores each gets (pure data, no Ray).

actors/placement.py turns a plan into a Ray placement group; rayrl/config.py validates a run's numbers
with it at load, so a layout that cannot fit fails before anything starts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from rayrl.config import ConfigError, RunConfig

MODES = ("colocated", "split")


@dataclass(frozen=True)
class PlacementPlan:
    """Which bundles each trainer rank and each engine use (pure data; :func:`plan_placement`)."""

    mode: str
    num_bundles: int
    trainer_bundles: tuple[int, ...]  # rank i -> bundle
    engine_bundles: tuple[tuple[int, ...], ...]  # engine j -> its tp_size bundles
    trainer_gpu_fraction: float  # num_gpus each trainer rank asks of its bundle
    engine_gpu_fraction: float  # num_gpus the engine-owning actor asks of its first bundle


def plan_placement(
    mode: str,
    num_gpus: int,
    *,
    trainer_ranks: int,
    num_engines: int,
    tp_size: int,
    trainer_gpus: int = 0,
    trainer_gpu_fraction: float = 0.5,
) -> PlacementPlan:
    """The bundle layout; raises ConfigError (naming the field) when the numbers do not fit."""
    if mode not in MODES:
        raise ConfigError(f"placement.mode: {mode!r} is not one of {', '.join(MODES)}")
    if num_gpus < 1:
        raise ConfigError(f"placement.num_gpus: must be >= 1, got {num_gpus}")
    engine_gpus = num_engines * tp_size
    if mode == "colocated":
        if trainer_ranks != num_gpus or engine_gpus != num_gpus:
            raise ConfigError(
                f"placement.num_gpus: colocated needs trainer.num_ranks ({trainer_ranks}) and "
                f"engine.num_engines x engine.tp_size ({engine_gpus}) both equal to {num_gpus}"
            )
        if not 0.0 < trainer_gpu_fraction < 1.0:
            raise ConfigError("placement.trainer_gpu_fraction: must be in (0, 1) when colocated")
        engine_first = 0
        fractions = (trainer_gpu_fraction, round(1.0 - trainer_gpu_fraction, 6))
    else:
        if trainer_gpus < 1 or trainer_gpus >= num_gpus:
            raise ConfigError(f"placement.trainer_gpus: split needs 1..{num_gpus - 1}, got {trainer_gpus}")
        if trainer_ranks != trainer_gpus or engine_gpus != num_gpus - trainer_gpus:
            raise ConfigError(
                f"placement.trainer_gpus: split gives the trainer {trainer_gpus} GPUs (trainer.num_ranks is "
                f"{trainer_ranks}) and the engines {num_gpus - trainer_gpus} (num_engines x tp_size is {engine_gpus})"
            )
        engine_first = trainer_gpus
        fractions = (1.0, 1.0)
    return PlacementPlan(
        mode=mode,
        num_bundles=num_gpus,
        trainer_bundles=tuple(range(trainer_ranks)),
        engine_bundles=tuple(
            tuple(range(engine_first + j * tp_size, engine_first + (j + 1) * tp_size)) for j in range(num_engines)
        ),
        trainer_gpu_fraction=fractions[0],
        engine_gpu_fraction=fractions[1],
    )


EXCLUSIVE_SCHEDULES = ("sync", "colocated_async")  # rollout and training take the devices in turn


@dataclass(frozen=True)
class CpuThreads:
    """torch threads per CPU engine and per trainer rank (see :func:`plan_cpu_threads`)."""

    engine: int
    trainer: int


def node_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan_cpu_threads(
    schedule: str,
    cores: int,
    *,
    num_engines: int,
    trainer_ranks: int,
    engine_threads: int = 0,
    trainer_threads: int = 0,
) -> CpuThreads:
    """On CPU the cores are the devices, so they are shared the way the schedule shares GPUs.

    ``sync`` and ``colocated_async`` give the engines and the trainer the devices in turn, so each gets
    every core while it holds them; ``async`` runs both at once, so each gets half. A count above 0 in
    the config (``engine.num_threads``, ``trainer.num_threads``) is kept as given. Resolving "all cores"
    matters under Ray: a Ray actor starts with ``OMP_NUM_THREADS=1``, so torch would otherwise use one core.
    """
    cores = max(1, cores)
    share = cores if schedule in EXCLUSIVE_SCHEDULES else max(1, cores // 2)
    rest = cores if schedule in EXCLUSIVE_SCHEDULES else max(1, cores - share)
    return CpuThreads(
        engine=engine_threads if engine_threads > 0 else max(1, share // max(1, num_engines)),
        trainer=trainer_threads if trainer_threads > 0 else max(1, rest // max(1, trainer_ranks)),
    )


def with_cpu_threads(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``engine.num_threads`` and ``trainer.num_threads`` resolved for this node's cores and
    the schedule (:func:`plan_cpu_threads`); the caller's config is not changed."""
    threads = plan_cpu_threads(cfg.pipeline.schedule, node_cores(), num_engines=cfg.engine.num_engines,
                               trainer_ranks=cfg.trainer.num_ranks, engine_threads=cfg.engine.num_threads,
                               trainer_threads=cfg.trainer.num_threads)
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, num_threads=threads.engine),
                               trainer=dataclasses.replace(cfg.trainer, num_threads=threads.trainer))
