"""Placement: one group of GPU bundles shared by trainer ranks and engines, colocated or split.

Checked on a CPU machine with Ray's logical GPUs (``ray.init(num_gpus=8)``): Ray hands out GPU ids for
them exactly as for real ones, so the GPU id an actor is given identifies the bundle it landed on.
"""

from __future__ import annotations

import pytest
import ray

from actors.placement import SharedPlacement
from rayrl.config import ConfigError, TrainerConfig, load_config
from rayrl.placement import plan_placement


def test_colocated_plan_shares_every_bundle():
    plan = plan_placement("colocated", 8, trainer_ranks=8, num_engines=4, tp_size=2)
    assert plan.trainer_bundles == tuple(range(8))
    assert plan.engine_bundles == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.trainer_gpu_fraction + plan.engine_gpu_fraction == pytest.approx(1.0)


def test_split_plan_gives_disjoint_bundles():
    plan = plan_placement("split", 8, trainer_ranks=4, num_engines=2, tp_size=2, trainer_gpus=4)
    assert plan.trainer_bundles == (0, 1, 2, 3)
    assert plan.engine_bundles == ((4, 5), (6, 7))
    assert (plan.trainer_gpu_fraction, plan.engine_gpu_fraction) == (1.0, 1.0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(mode="colocated", num_gpus=8, trainer_ranks=4, num_engines=8, tp_size=1), "placement.num_gpus"),
        (dict(mode="split", num_gpus=8, trainer_ranks=4, num_engines=4, tp_size=1, trainer_gpus=8),
         "placement.trainer_gpus"),
        (dict(mode="split", num_gpus=8, trainer_ranks=4, num_engines=2, tp_size=1, trainer_gpus=4),
         "placement.trainer_gpus"),
        (dict(mode="diagonal", num_gpus=8, trainer_ranks=8, num_engines=8, tp_size=1), "placement.mode"),
        (dict(mode="colocated", num_gpus=8, trainer_ranks=8, num_engines=8, tp_size=1, trainer_gpu_fraction=1.0),
         "placement.trainer_gpu_fraction"),
    ],
)  # fmt: skip
def test_plans_that_do_not_fit_name_the_field(kwargs, field):
    mode, num_gpus = kwargs.pop("mode"), kwargs.pop("num_gpus")
    with pytest.raises(ConfigError, match=field):
        plan_placement(mode, num_gpus, **kwargs)


def test_config_checks_the_layout_at_load():
    base = ["placement.mode=colocated", "placement.num_gpus=8", "engine.num_engines=8"]
    with pytest.raises(ConfigError, match="placement.num_gpus"):
        load_config(None, base + ["trainer.num_ranks=4"])
    cfg = load_config(None, base + ["trainer.num_ranks=8", "trainer.backend=megatron", "trainer.tp_size=2"])
    assert cfg.placement.mode == "colocated" and cfg.trainer.tp_size == 2
    with pytest.raises(ConfigError, match="trainer.num_ranks"):
        load_config(None, base + ["trainer.num_ranks=8", "trainer.backend=megatron", "trainer.tp_size=3"])
    with pytest.raises(ConfigError, match="trainer.tp_size"):
        load_config(None, ["trainer.tp_size=2"])  # the torch backend has no tensor parallelism


@ray.remote(num_cpus=0)
class Where:
    """Reports the GPU ids Ray gave this actor (one id: the GPU of the bundle it sits in)."""

    def gpus(self) -> list[str]:
        return [str(int(g)) for g in ray.get_gpu_ids()]


@pytest.fixture(scope="module")
def ray_with_8_logical_gpus():
    ray.init(num_cpus=4, num_gpus=8, include_dashboard=False)
    yield
    ray.shutdown()


def _on(placement: SharedPlacement, options: dict) -> list[str]:
    actor = Where.options(**options).remote()
    try:
        return ray.get(actor.gpus.remote(), timeout=120)
    finally:
        ray.kill(actor)


def test_actors_land_on_their_bundles(ray_with_8_logical_gpus):
    plan = plan_placement("colocated", 8, trainer_ranks=8, num_engines=4, tp_size=2)
    placement = SharedPlacement(plan, cpus_per_bundle=0.25)
    try:
        gpus = placement.bundle_gpus
        assert sorted(gpus, key=int) == [str(i) for i in range(8)]  # one distinct GPU per bundle
        trainers = [Where.options(**placement.trainer_options(r, num_cpus=0)).remote() for r in range(8)]
        engines = [Where.options(**placement.engine_options(j)).remote() for j in range(4)]
        assert ray.get([t.gpus.remote() for t in trainers], timeout=180) == [[gpus[r]] for r in range(8)]
        assert ray.get([e.gpus.remote() for e in engines], timeout=180) == [[gpus[2 * j]] for j in range(4)]
        assert placement.all_engine_devices() == [f"{gpus[2 * j]},{gpus[2 * j + 1]}" for j in range(4)]
        # trainer (0.5) + engine (0.5) fill bundle 0: nothing more fits there
        extra = Where.options(num_gpus=0.1, scheduling_strategy=placement._strategy(0)).remote()
        ready, _ = ray.wait([extra.gpus.remote()], timeout=3)
        assert not ready
        for a in [*trainers, *engines, extra]:
            ray.kill(a)
    finally:
        placement.remove()

    plan = plan_placement("split", 8, trainer_ranks=4, num_engines=4, tp_size=1, trainer_gpus=4)
    placement = SharedPlacement(plan, cpus_per_bundle=0.25)
    try:
        gpus = placement.bundle_gpus
        trainer_gpus = {_on(placement, placement.trainer_options(r, num_cpus=0))[0] for r in range(4)}
        assert trainer_gpus == set(gpus[:4])
        assert placement.all_engine_devices() == gpus[4:]
        assert _on(placement, placement.engine_options(3)) == [gpus[7]]
    finally:
        placement.remove()


def test_trainer_group_uses_the_shared_placement(ray_with_8_logical_gpus, tiny_model_dir):
    """The real TrainerGroup: its ranks go to the planned bundles (gloo: logical GPUs have no CUDA)."""
    from actors.trainer import TrainerGroup

    cfg = load_config(None, ["placement.mode=colocated", "placement.num_gpus=2", "placement.cpus_per_bundle=1",
                             "trainer.num_ranks=2", "engine.num_engines=2"])  # fmt: skip
    placement = SharedPlacement.from_config(cfg)
    assert placement.plan.trainer_bundles == (0, 1) and SharedPlacement.from_config(load_config(None)) is None
    group = None
    try:
        group = TrainerGroup(TrainerConfig(num_ranks=2, num_threads=1, tis_cap=0.0), str(tiny_model_dir),
                             placement=placement)  # fmt: skip
        seen = ray.get([r.__ray_call__.remote(lambda self: [str(int(g)) for g in ray.get_gpu_ids()])
                        for r in group.ranks])  # fmt: skip
        assert seen == [[placement.bundle_gpus[0]], [placement.bundle_gpus[1]]]
    finally:
        if group is not None:
            group.shutdown()
        placement.remove()
