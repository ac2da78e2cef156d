"""The pipeline over a real three-node Ray cluster on this machine (``ray.cluster_utils.Cluster``).

A head and two worker nodes, each a separate raylet with its own resources and one logical GPU. Two
layouts of one shared placement group, each trained for two real steps on the tiny CPU model:

- ``split`` (async): the trainer rank on one node, the two engines on the two others; weights cross
  nodes by a gloo broadcast group (NCCL on GPU);
- ``colocated`` (colocated_async): one trainer rank and one engine on every node, sharing the node's GPU
  bundle; weights go by shared-memory handles from the rank beside each engine (CUDA IPC on GPU);
  checkpoints go to S3 (a local moto server) from every node, and resume downloads them on every node.

Each test asserts where every engine and trainer rank ran (the node of its bundle), that every engine
served traffic and reports each new policy version, and then kills one node's engine actor in the
middle of a rollout: the run goes on, the engine comes back on its bundle with the current weights, and
every episode of every step is there exactly once. The split layout then loses a whole engine node (its
raylet SIGKILLed with every process of the node, as a machine dies): the run goes on without it, no
replacement is started while Ray cannot place its bundle, and once a spare node joins, Ray places the
bundle there and the engine comes back on it with the current weights: one death, one restart, one
count, one log line. tests/multinode/test_node_loss.py loses a trainer node in every phase.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.pipeline.run_config import pipeline_config, step_episodes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# the GCS declares a node dead ~3 s after its raylet stops answering (Ray's default: ~30 s)
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                   "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    """The cluster, and a local S3 (a moto server process) every node's workers reach as if it were S3."""
    from tests.s3_server import S3_TEST_ENV, moto_s3_server

    with moto_s3_server(tmp_path_factory.mktemp("moto") / "moto.log") as s3_url:
        env = {**S3_TEST_ENV, "AWS_ENDPOINT_URL_S3": s3_url}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the driver's own boto3 (the checkpoint store's commit and listing)
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 6, "num_gpus": 1, "_system_config": FAST_NODE_DEATH})
        workers = [cluster.add_node(num_cpus=3, num_gpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), **env}})
        try:
            yield cluster, workers
        finally:
            ray.shutdown()
            cluster.shutdown()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _config(tmp_path: Path, tiny_model_dir: Path, *overrides: str):
    return pipeline_config(
        tmp_path, tiny_model_dir, "rollout.group_size=4", "engine.host=0.0.0.0", "engine.num_threads=1",
        "trainer.num_threads=1", "placement.num_gpus=3", "placement.cpus_per_bundle=1", "sandbox_pool.min_warm=4",
        "trainer.steps=6", *overrides)


def _one_step_of_8_each_episode_once(rows: list[dict]) -> None:
    """A step took 8 episodes (2 groups of 4), all ok; the groups it set aside (too stale under the async
    schedule, rayrl/records.py) follow them marked ``discarded``; no (group, index) is written twice."""
    taken = [r for r in rows if not r.get("discarded")]
    assert len(taken) == 8 and len({(r["group_id"], r["index"]) for r in taken}) == 8, taken
    assert all(r["status"] == "ok" for r in taken), [r["error"] for r in taken]
    assert len({(r["group_id"], r["index"]) for r in rows}) == len(rows), rows
    assert all(r["discarded"] in ("stale", "rerun") for r in rows if r.get("discarded")), rows


def _steps_with_versions(pipe, n: int) -> list[dict]:
    """``n`` steps; after each, every engine reports the trainer's new policy version."""
    history = []
    for _ in range(n):
        before = pipe.version
        history.append(pipe.run_step())
        assert pipe.version == before + 1  # index_reward: every group has variance, every step trains
        assert set(pipe.engines.weight_versions().values()) == {str(pipe.version)}
        assert len(pipe.engines.weight_versions()) == len(pipe.engines.slots)
    return history


def _kill_an_engine_mid_rollout(pipe, driver_node: str) -> None:
    """Kill the engine actor of a node other than the driver's while episodes run; go on until it is back
    and has served a whole step; check it came back on its bundle with the current weights and that no
    episode was lost or counted twice."""
    slot = next(s for s in pipe.engines.slots if s.info["node_id"] != driver_node)
    node, bundles, old_url = slot.info["node_id"], slot.info["bundles"], slot.url

    def kill() -> None:
        deadline = time.monotonic() + 120
        while len(pipe.dispatcher.running) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # inside the episodes: first LLM calls made, sandbox work going on
        ray.kill(slot.actor)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    first = pipe.step + 1
    history = [pipe.run_step()]
    deadline = time.monotonic() + 300  # the new engine starts while steps go on (a few seconds each)
    while pipe.failure_counts["engine_restarts"] == 0 or slot.state != "live" or len(history) < 2:
        assert time.monotonic() < deadline, history
        history.append(pipe.run_step())
    history.append(pipe.run_step())  # a whole step with the engine back
    killer.join(5)
    assert pipe.failure_counts["engine_restarts"] == 1 and slot.restarts == 1
    assert slot.info["node_id"] == node and slot.info["bundles"] == bundles  # back on its bundle
    assert slot.url != old_url and slot.url in pipe.engine_urls
    assert set(pipe.engines.weight_versions().values()) == {str(pipe.version)}  # current weights
    for step in range(first, pipe.step + 1):
        _one_step_of_8_each_episode_once(step_episodes(pipe.cfg, step))


def _lose_an_engine_node(pipe, cluster, caplog) -> None:
    """Kill the node of an engine (not the driver's, not the trainer's) mid-rollout, as a machine dies; steps go
    on without it and no replacement starts while its bundle cannot be placed; a spare node joins, the bundle
    is placed there, and the engine comes back on it with the current weights. One restart, one count, one
    line; every episode of every step there exactly once."""
    import logging

    driver_node = ray.get_runtime_context().get_node_id()
    (rank,) = pipe.trainer.places()
    slot = next(s for s in pipe.engines.slots if s.info["node_id"] not in (driver_node, rank.node_id))
    node = next(n for n in cluster.worker_nodes if n.node_id == slot.info["node_id"])
    restarts, counted = slot.restarts, pipe.failure_counts["engine_restarts"]
    caplog.set_level(logging.WARNING, logger="rayrl")
    caplog.clear()

    def kill() -> None:
        while len(pipe.dispatcher.running) < 2:
            time.sleep(0.05)
        time.sleep(0.5)
        cluster.remove_node(node, allow_graceful=False)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    first = pipe.step + 1
    pipe.run_step()
    killer.join(60)
    pipe.run_step()  # a whole step on the other engine; the bundle has no node to go to
    assert slot.state == "down" and slot.start_ref is None and slot.failed_starts == 0
    assert pipe.failure_counts["engine_restarts"] == counted + 1 and slot.restarts == restarts + 1

    spare = cluster.add_node(num_cpus=3, num_gpus=1)  # Ray places the lost bundle on it
    deadline = time.monotonic() + 300
    while slot.state != "live":
        assert time.monotonic() < deadline, slot
        pipe.run_step()
    pipe.run_step()  # a whole step with the engine back
    assert slot.info["node_id"] == spare.node_id  # where Ray placed the lost bundle
    assert slot.info["bundles"] == list(pipe.placement.engine_bundles(slot.index))
    assert set(pipe.engines.weight_versions().values()) == {str(pipe.version)}  # current weights
    assert pipe.failure_counts["engine_restarts"] == counted + 1 and slot.restarts == restarts + 1
    assert slot.failed_starts == 0
    down = [r for r in caplog.records if "is down" in r.getMessage()]
    assert len(down) == 1 and f"engine {slot.index} " in down[0].getMessage(), [r.getMessage() for r in down]
    for step in range(first, pipe.step + 1):
        _one_step_of_8_each_episode_once(step_episodes(pipe.cfg, step))


@pytest.mark.timeout(1500)  # a loaded 2-core machine: the pipeline's start, ~10 steps, an engine node's loss
def test_split_layout_trainer_on_one_node_engines_on_two_others(three_nodes, tiny_model_dir, tmp_path, caplog):
    from actors.pipeline import Pipeline

    cluster, _ = three_nodes
    cfg = _config(tmp_path, tiny_model_dir, "exp_id=mn-split", "placement.mode=split", "placement.trainer_gpus=1",
                  "trainer.num_ranks=1", "engine.num_engines=2", "pipeline.schedule=async")
    pipe = Pipeline(cfg)
    try:
        all_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        (rank,) = pipe.trainer.places()
        engines = pipe.engines.infos()
        placement = pipe.placement
        assert rank.node_id == placement.bundle_nodes[placement.trainer_bundle(0)]
        for j, info in enumerate(engines):
            assert info["node_id"] == placement.bundle_nodes[placement.engine_bundles(j)[0]]
            assert info["gpu_ids"] == [placement.bundle_gpus[placement.engine_bundles(j)[0]]]
        engine_nodes = {e["node_id"] for e in engines}
        assert len(engine_nodes) == 2 and rank.node_id not in engine_nodes
        assert engine_nodes | {rank.node_id} == all_nodes  # three nodes, one role each
        assert pipe.weights.transport == "distributed"  # the only transport that crosses nodes

        _steps_with_versions(pipe, 2)
        served = pipe.engines.work_stats()
        assert len(served) == 2 and all(w["requests"] > 0 for w in served.values()), served

        _kill_an_engine_mid_rollout(pipe, ray.get_runtime_context().get_node_id())
        _lose_an_engine_node(pipe, cluster, caplog)
    finally:
        pipe.shutdown()


@pytest.mark.timeout(1200)
def test_colocated_layout_spread_over_three_nodes(three_nodes, tiny_model_dir, tmp_path):
    import boto3

    from actors.pipeline import Pipeline

    boto3.client("s3").create_bucket(Bucket="mn-checkpoints")
    cfg = _config(tmp_path, tiny_model_dir, "exp_id=mn-colocated", "placement.mode=colocated",
                  "trainer.num_ranks=3", "engine.num_engines=3", "pipeline.schedule=colocated_async",
                  "pipeline.partial_rollout=true", "pipeline.checkpoint_dir=s3://mn-checkpoints/run")
    pipe = Pipeline(cfg)
    try:
        all_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        ranks = pipe.trainer.places()
        engines = pipe.engines.infos()
        placement = pipe.placement
        for r, place in enumerate(ranks):
            assert place.node_id == placement.bundle_nodes[placement.trainer_bundle(r)]
        for j, info in enumerate(engines):
            assert info["bundles"] == [placement.trainer_bundle(j)]  # engine j shares rank j's bundle
            assert info["node_id"] == ranks[j].node_id
        assert {e["node_id"] for e in engines} == {p.node_id for p in ranks} == all_nodes  # one pair per node
        plan = pipe.weights.plan
        assert plan.transport == "tensor" and plan.by_rank == {0: (0,), 1: (1,), 2: (2,)}  # node-local

        _steps_with_versions(pipe, 2)
        served = pipe.engines.work_stats()
        assert len(served) == 3 and all(w["requests"] > 0 for w in served.values()), served

        # a checkpoint from ranks on three nodes: one rank per node uploads, the marker goes up last;
        # resume has one rank per node download it, and every rank loads it
        where = pipe.save_checkpoint()
        assert where == "s3://mn-checkpoints/run/step000002"
        keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="mn-checkpoints")["Contents"]}
        assert {f"run/step000002/rank{r}.pt" for r in range(3)} | {"run/step000002/pipeline.json"} <= keys
        assert pipe.resume() and pipe.version == 2 and pipe.step == 2

        _kill_an_engine_mid_rollout(pipe, ray.get_runtime_context().get_node_id())
    finally:
        pipe.shutdown()
