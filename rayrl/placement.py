"""Placement plans: which GPU bundles the trainer ranks and the engines use (pure data, no Ray).

actors/ turns a plan into a Ray placement group. :func:`plan_placement` is the one home of the layout:
it checks that the numbers fit and lays out the bundles, and the config runs it at load (RunConfig), so a
layout that cannot fit fails, naming the field, before anything starts; CPU thread counts are resolved
with the rest of the config (rayrl.resolve).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rayrl.config import ConfigError

LAYOUT_MODES = ("colocated", "split")  # the placement modes that lay out a shared placement group


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
    """The bundle layout of trainer ranks and engines over ``num_gpus`` shared bundles in ``mode``.

    colocated: every bundle holds one trainer rank and one engine GPU, each claiming its fraction.
    split: the first ``trainer_gpus`` bundles train, the rest serve. Raises ConfigError naming the field
    when the numbers do not fit (the config calls this at load for exactly that).
    """
    _check_layout(mode, num_gpus, trainer_ranks, num_engines * tp_size, trainer_gpus, trainer_gpu_fraction)
    if mode == "colocated":
        engine_first = 0
        fractions = (trainer_gpu_fraction, round(1.0 - trainer_gpu_fraction, 6))
    else:
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


def _check_layout(mode: str, num_gpus: int, trainer_ranks: int, engine_gpus: int, trainer_gpus: int,
                  trainer_gpu_fraction: float) -> None:
    """Whether the numbers fit; ConfigError naming the field when not (:func:`plan_placement`)."""
    if mode not in LAYOUT_MODES:
        raise ConfigError(f"placement.mode: {mode!r} is not one of {', '.join(LAYOUT_MODES)}")
    if num_gpus < 1:
        raise ConfigError(f"placement.num_gpus: must be >= 1, got {num_gpus}")
    if mode == "colocated":
        if trainer_ranks != num_gpus or engine_gpus != num_gpus:
            raise ConfigError(
                f"placement.num_gpus: colocated needs trainer.num_ranks ({trainer_ranks}) and "
                f"engine.num_engines x engine.tp_size ({engine_gpus}) both equal to {num_gpus}"
            )
        if not 0.0 < trainer_gpu_fraction < 1.0:
            raise ConfigError("placement.trainer_gpu_fraction: must be in (0, 1) when colocated")
        return
    if trainer_gpus < 1 or trainer_gpus >= num_gpus:
        raise ConfigError(f"placement.trainer_gpus: split needs 1..{num_gpus - 1}, got {trainer_gpus}")
    if trainer_ranks != trainer_gpus or engine_gpus != num_gpus - trainer_gpus:
        raise ConfigError(
            f"placement.trainer_gpus: split gives the trainer {trainer_gpus} GPUs (trainer.num_ranks is "
            f"{trainer_ranks}) and the engines {num_gpus - trainer_gpus} (num_engines x tp_size is "
            f"{engine_gpus})"
        )


def order_bundles(bundle_nodes: Sequence[str], bundle_gpus: Sequence[str]) -> list[int]:
    """Bundle indices in (node, GPU id) order: the plan's logical slots are laid over this order.

    Ray places a group's bundles where they fit, not in index order, so bundle ``i`` need not sit next
    to bundle ``i + 1``. Reading the slots in node order keeps a tensor-parallel engine's consecutive
    slots on one node (a node's GPUs are contiguous in the order) and a colocated trainer rank on its
    engine's GPU. Nodes keep the order of their first bundle, so bundle 0's node comes first."""
    if len(bundle_nodes) != len(bundle_gpus):
        raise ValueError("one node and one GPU id per bundle")
    first_seen: dict[str, int] = {}
    for i, node in enumerate(bundle_nodes):
        first_seen.setdefault(node, i)

    def gpu_key(gpu: str) -> tuple[int, str]:
        return (int(gpu), "") if gpu.isdigit() else (1 << 30, gpu)

    return sorted(range(len(bundle_nodes)), key=lambda b: (first_seen[bundle_nodes[b]], gpu_key(bundle_gpus[b]), b))
