"""A whole node lost in every phase of a colocated run, on a real two-node Ray cluster on this machine.

``ray.cluster_utils.Cluster``: a head node (the driver, the gateway, the sandboxes, one logical GPU) and a
worker node (one logical GPU). Trainer rank and engine pairs share each node's GPU bundle
(``colocated_async``). The worker node is killed as a machine dies, without notice (every process of
it, raylet first, then its workers, SIGKILLed: ``_kill_machine``), at the moment one phase
begins. ``driver.py`` runs each time exactly as a user runs it, and every run after the first is the
resume command the previous one printed, on a fresh worker node added in place of the dead one:

1. rollout: the node dies as step 2's rollout begins, with episodes running (its engine goes too); the
   run stops when the trainer is next needed (onload), with a checkpoint of step 1 written by the
   surviving rank, step 2's groups untrained;
2. train: the node dies as the trainer step starts: that checkpoint is still the newest and is named;
3. offload, after the trainer step: the survivor holds step 2's update and writes step 2;
4. weight push: step 3, the same way;
5. checkpoint: the node dies while step 4's checkpoint is written; the survivor writes it again;
6. the last resume runs to the end (step 5).

Each stopped run exits with code 3 and one line that names the phase and the cause, the checkpoint and
the resume command. At the end no task was trained twice and none was skipped: the trained tasks and
the groups the last checkpoint holds untrained are the data's first tasks, in order, each once.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import psutil
import pytest
from ray._private import ray_constants
from ray.cluster_utils import Cluster

from tests.pipeline.run_config import pipeline_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# the GCS declares a node dead ~3 s after its raylet stops answering (Ray's default: ~30 s)
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                   "health_check_failure_threshold": 3}


@pytest.fixture
def two_nodes():
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT)  # the raylets, and so every worker, import this checkout
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 6, "num_gpus": 1, "_system_config": FAST_NODE_DEATH})
    try:
        cluster.add_node(num_cpus=3, num_gpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


class NodeKiller:
    """Kills the worker node when the armed phase begins (the patched method's first call)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.armed = ""
        self.killed: list[str] = []

    def kill_if(self, phase: str) -> None:
        if self.armed == phase:
            self.armed = ""
            (worker,) = self.cluster.worker_nodes  # the one worker node (each dead one is replaced)
            _kill_machine(self.cluster, worker)
            self.killed.append(phase)

    def before(self, phase: str, method):
        def wrapper(obj, *args, **kwargs):
            self.kill_if(phase)
            return method(obj, *args, **kwargs)

        return wrapper

    def during_rollout(self, method):
        """Kill as step 2's rollout begins: episodes of the groups the schedule keeps running ahead are in
        flight, some of their LLM calls on the doomed node's engine."""
        def wrapper(schedule, *args, **kwargs):
            if schedule.state.step == 2:
                self.kill_if("rollout")
            return method(schedule, *args, **kwargs)

        return wrapper

    def after(self, method, rearm: dict[str, str]):
        """``method`` runs, then what is armed moves on (``rearm``): to kill in a phase that follows it."""
        def wrapper(obj, *args, **kwargs):
            out = method(obj, *args, **kwargs)
            self.armed = rearm.get(self.armed, self.armed)
            return out

        return wrapper


def _kill_machine(cluster: Cluster, node) -> None:
    """Every process of ``node`` SIGKILLed, raylet first, as a machine that dies. ``remove_node`` kills Ray's
    own processes; the workers (trainer rank, engine) would notice their raylet gone only a moment later and
    could still answer the phase's first call, which a dead machine never does."""
    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    workers = psutil.Process(raylet).children(recursive=True)
    cluster.remove_node(node, allow_graceful=False)
    for process in workers:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _newest_checkpoint(run_dir: Path) -> tuple[int, dict]:
    steps = sorted(run_dir.glob("checkpoints/step*/pipeline.json"))
    return int(steps[-1].parent.name[4:]), json.loads(steps[-1].read_text())


def _run(argv: list[str], capfd) -> tuple[int, str]:
    import driver

    code = driver.main(argv)
    out, err = capfd.readouterr()
    return code, out + err


@pytest.mark.timeout(2400)  # six runs of driver.py, each starting its engines and trainer
def test_a_node_lost_in_any_phase_stops_the_run_cleanly_and_it_resumes_exactly(two_nodes, tiny_model_dir,
                                                                                 tmp_path, monkeypatch, capfd):
    from actors.trainer import TrainerGroup
    from actors.weight_sync import WeightSync
    from rayrl.orchestration.schedules import Schedule

    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"id": f"t-{i}", "prompt": f"What is {i} + 1?",
                                        "metadata": {"question": f"What is {i} + 1?", "answer": i + 1}}) + "\n"
                            for i in range(60)))
    overrides = [
        f"model.path={tiny_model_dir}", "exp_id=node-loss", f"logging.output_dir={tmp_path / 'runs'}",
        f"data.train_path={data}", "data.val_path=null", "data.shuffle=false", "engine.dtype=float32",
        "rollout.agent=tests.pipeline.pipeline_support:SlowToolAgent",
        "rollout.reward=tests.pipeline.pipeline_support:index_reward", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_tokens=8", "rollout.episode_timeout_s=60", "trainer.steps=5",
        "trainer.micro_batch_tokens=2048", "sandbox_pool.min_warm=2", "logging.tensorboard=false",
        "logging.plot=false", "engine.host=0.0.0.0", "engine.num_threads=1", "trainer.num_threads=1",
        "trainer.num_ranks=2", "engine.num_engines=2", "placement.mode=colocated", "placement.num_gpus=2",
        "placement.cpus_per_bundle=1", "pipeline.schedule=colocated_async", "pipeline.partial_rollout=true",
        f"ray.address={two_nodes.address}",
    ]
    cfg = pipeline_config(tmp_path, tiny_model_dir, *overrides)  # validates the overrides before Ray
    run_dir = cfg.run_dir
    killer = NodeKiller(two_nodes)
    monkeypatch.setattr(Schedule, "collect", killer.during_rollout(Schedule.collect))
    # "offload" and "weight push" are armed by the trainer step (the schedule also offloads when it starts, and
    # a resume pushes the loaded weights): the colocated step goes train -> push -> offload
    # (rayrl/orchestration/schedules.py), so the step's own push or offload after its train is the one killed
    after_train = {"offload-next": "offload", "push-next": "weight push"}
    train = killer.before("train", TrainerGroup.train)
    monkeypatch.setattr(TrainerGroup, "train", killer.after(train, after_train))
    monkeypatch.setattr(TrainerGroup, "offload", killer.before("offload", TrainerGroup.offload))
    monkeypatch.setattr(WeightSync, "push", killer.before("weight push", WeightSync.push))
    monkeypatch.setattr(TrainerGroup, "save_checkpoint", killer.before("checkpoint", TrainerGroup.save_checkpoint))

    argv = ["--config", str(ROOT / "examples" / "calculator" / "config.yaml"), *overrides]
    # (phase armed, the phase the failure names, newest checkpoint after it, extra overrides)
    plan = [("rollout", "onload", 1, []), ("train", "train", 1, []), ("offload-next", "offload", 2, []),
            ("push-next", "weight push", 3, []),
            ("checkpoint", "checkpoint", 4, ["pipeline.checkpoint_interval=1"])]
    for armed, phase, step, extra in plan:
        killer.armed = armed
        code, output = _run(argv + extra, capfd)
        assert code == 3 and killer.killed[-1] == phase.replace("onload", "rollout"), output[-3000:]
        stops = [line for line in output.splitlines() if "run stopped" in line]
        assert len(stops) == 1, stops  # one line: the cause, the checkpoint, the command
        # the rank's process is gone: ActorUnavailableError until Ray declares the node dead, ActorDiedError after
        assert f"trainer rank failure in {phase}: rank " in stops[0], stops
        assert "ActorDiedError" in stops[0] or "ActorUnavailableError" in stops[0], stops
        newest, state = _newest_checkpoint(run_dir)
        assert newest == step and state["policy_version"] == step, (phase, newest, state)
        assert f"Checkpoint: {run_dir / 'checkpoints' / f'step{step:06d}'}." in stops[0], stops
        resume = re.search(r"Resume with: python driver.py (.*)$", stops[0]).group(1).split()
        assert resume == ["--config", str(run_dir / "config.yaml"), "--resume"]
        two_nodes.add_node(num_cpus=3, num_gpus=1)  # a new machine in place of the dead one
        two_nodes.wait_for_nodes()
        argv = resume + [f"ray.address={two_nodes.address}"]

    code, output = _run(argv, capfd)  # the last resume runs to the end
    assert code == 0 and "run stopped" not in output, output[-3000:]
    assert killer.killed == ["rollout", "train", "offload", "weight push", "checkpoint"]

    trained = []
    for step in range(1, 6):
        path = run_dir / "episodes" / f"step{step:06d}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == 4 and all(r["status"] == "ok" for r in rows), rows
        tasks = {r["group_id"]: r["task_id"] for r in rows}
        trained += list(tasks.values())
    newest, state = _newest_checkpoint(run_dir)
    assert newest == 5 and state["policy_version"] == 5
    untrained = [row["task"]["task_id"] for row in state["schedule"]["untrained_groups"]]
    assert len(set(trained)) == len(trained) == 10  # no task trained twice
    done = sorted(trained + untrained, key=lambda t: int(t[2:]))
    assert done == [f"t-{i}" for i in range(len(done))]  # and none skipped
