"""Placement: one group of GPU bundles shared by trainer ranks and engines, colocated or split.

Checked on a CPU machine with Ray's logical GPUs (``ray.init(num_gpus=8)``): Ray hands out GPU ids for
them exactly as for real ones, so the GPU id an actor is given identifies the bundle it landed on.
"""

from __future__ import annotations

import time

import pytest
import ray

from actors.placement_group import SharedPlacement
from rayrl.config import ConfigError, TrainerConfig, load_config
from rayrl.placement import plan_placement
from rayrl.resolve import load_checked


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
        load_checked(None, base + ["trainer.num_ranks=4"])
    cfg = load_checked(None, base + ["trainer.num_ranks=8", "trainer.backend=megatron", "trainer.tp_size=2"])
    assert cfg.placement.mode == "colocated" and cfg.trainer.tp_size == 2
    with pytest.raises(ConfigError, match="trainer.num_ranks"):
        load_config(None, base + ["trainer.num_ranks=8", "trainer.backend=megatron", "trainer.tp_size=3"])
    with pytest.raises(ConfigError, match="trainer.tp_size"):
        load_checked(None, ["trainer.tp_size=2", "trainer.num_ranks=2"])  # the torch backend: no tensor parallel


@ray.remote(num_cpus=0)
class Where:
    """Reports the GPU ids Ray gave this actor (one id: the GPU of the bundle it sits in)."""

    def gpus(self) -> list[str]:
        return [str(int(g)) for g in ray.get_gpu_ids()]


@pytest.fixture(scope="module")
def ray_with_8_logical_gpus():
    from tests.ray_support import ROOT

    ray.init(num_cpus=4, num_gpus=8, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


def _on(placement: SharedPlacement, options: dict) -> list[str]:
    actor = Where.options(**options).remote()
    try:
        return ray.get(actor.gpus.remote(), timeout=120)
    finally:
        ray.kill(actor)


@pytest.mark.slow  # ~70 s; fast: test_trainer_group_uses_the_shared_placement
def test_actors_land_on_their_bundles(ray_with_8_logical_gpus):
    plan = plan_placement("colocated", 8, trainer_ranks=8, num_engines=4, tp_size=2)
    placement = SharedPlacement(plan, cpus_per_bundle=0.25)
    try:
        gpus = placement.bundle_gpus
        assert sorted(gpus, key=int) == [str(i) for i in range(8)]  # one distinct GPU per bundle
        assert sorted(placement.order) == list(range(8))
        trainers = [Where.options(**placement.trainer_options(r, num_cpus=0)).remote() for r in range(8)]
        engines = [Where.options(**placement.engine_seat(j).actor_options()).remote() for j in range(4)]
        assert ray.get([t.gpus.remote() for t in trainers], timeout=180) == [
            [gpus[placement.trainer_bundle(r)]] for r in range(8)]
        assert ray.get([e.gpus.remote() for e in engines], timeout=180) == [
            [gpus[placement.engine_bundles(j)[0]]] for j in range(4)]
        # colocated: engine j's two bundles are those of trainer ranks 2j and 2j+1
        assert [placement.engine_bundles(j) for j in range(4)] == [
            (placement.trainer_bundle(2 * j), placement.trainer_bundle(2 * j + 1)) for j in range(4)]
        # trainer (0.5) + engine (0.5) fill an engine's first bundle: nothing more fits there
        first = placement.engine_bundles(0)[0]
        extra = Where.options(num_gpus=0.1, scheduling_strategy=placement._strategy(first)).remote()
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
        engine_gpus = {_on(placement, placement.engine_seat(j).actor_options())[0] for j in range(4)}
        assert len(trainer_gpus) == 4 and len(engine_gpus) == 4 and not trainer_gpus & engine_gpus
        assert trainer_gpus | engine_gpus == set(gpus)
    finally:
        placement.remove()


@pytest.mark.slow  # ~50 s; fast: test_trainer_group_uses_the_shared_placement (Ray holds what the plan gives)
def test_tensor_parallel_engine_holds_every_gpu_of_its_bundles(ray_with_8_logical_gpus, tiny_model_dir, tmp_path):
    """A real EngineActor with engine.tp_size=2 (split layout): Ray accounts for both of its GPUs, one by
    the actor and one by its GpuSeat, and the server is given both (here a CPU engine, which ignores them)."""
    from actors.engine_fleet import EngineFleet

    cfg = load_config(None, ["placement.mode=split", "placement.num_gpus=3", "placement.trainer_gpus=1",
                             "trainer.num_ranks=1", "engine.num_engines=1", "engine.tp_size=2", "engine.backend=cpu",
                             "engine.num_threads=1", "engine.dtype=float32", "placement.cpus_per_bundle=0.25"])
    placement = SharedPlacement.from_config(cfg)
    fleet = None
    try:
        fleet = EngineFleet(cfg.engine, str(tiny_model_dir), str(tmp_path / "logs"), placement.engine_seats())
        info = fleet.infos()[0]
        bundles = placement.engine_bundles(0)
        assert info["bundles"] == list(bundles)
        assert sorted(info["gpu_ids"]) == sorted(placement.bundle_gpus[b] for b in bundles)
        pg = placement.group.id.hex()
        free = ray.available_resources()
        assert all(free.get(f"GPU_group_{b}_{pg}", 0.0) == 0.0 for b in bundles)  # both taken, in Ray's books
        trainer_bundle = placement.trainer_bundle(0)
        assert free.get(f"GPU_group_{trainer_bundle}_{pg}") == 1.0  # the trainer's bundle is still free
    finally:
        if fleet is not None:
            fleet.shutdown()
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
        group = TrainerGroup(TrainerConfig(num_ranks=2, num_threads=1), str(tiny_model_dir),
                             placement=placement)  # fmt: skip
        seen = ray.get([r.__ray_call__.remote(lambda self: [str(int(g)) for g in ray.get_gpu_ids()])
                        for r in group.ranks])  # fmt: skip
        assert seen == [[placement.bundle_gpus[placement.trainer_bundle(r)]] for r in range(2)]
        assert [p.bundle for p in group.places()] == [placement.trainer_bundle(r) for r in range(2)]
    finally:
        if group is not None:
            group.shutdown()
        placement.remove()


# ~30 s: a whole pipeline; tests/pipeline/test_schedules_e2e.py runs the colocated layout in make test
@pytest.mark.slow
def test_pipeline_places_trainer_and_engines_on_one_bundle(ray_with_8_logical_gpus, tiny_model_dir, tmp_path):
    """placement.mode=colocated in a real Pipeline: the trainer rank and the engine actor share the bundle
    (each with its fraction of its GPU), weights go by shared-memory handles, and a colocated_async step
    runs there."""
    from actors.pipeline import Pipeline
    from tests.pipeline.run_config import pipeline_config

    cfg = pipeline_config(tmp_path, tiny_model_dir, "exp_id=placed", "placement.mode=colocated",
                          "placement.num_gpus=1", "placement.cpus_per_bundle=1", "pipeline.schedule=colocated_async",
                          "trainer.steps=1")  # fmt: skip
    pipe = Pipeline(cfg)
    try:
        gpu = pipe.placement.bundle_gpus[0]
        gpu_ids = lambda self: [str(int(g)) for g in ray.get_gpu_ids()]  # noqa: E731
        assert ray.get(pipe.trainer.ranks[0].__ray_call__.remote(gpu_ids)) == [gpu]
        assert pipe.engines.infos()[0]["gpu_ids"] == [gpu] and pipe.weights.transport == "tensor"
        metrics = pipe.run_step()
        assert metrics["train/policy_version"] == 1 and metrics["rollout/episodes_ok"] == 4
    finally:
        pipe.shutdown()
    deadline = time.monotonic() + 30  # the shared group goes with the pipeline (Ray frees it asynchronously)
    while ray.available_resources().get("GPU") != 8:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)
