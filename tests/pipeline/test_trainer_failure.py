"""A trainer rank that dies mid-run: the call raises TrainerFailure (no hang) in whatever phase, a surviving
rank writes a checkpoint, and a fresh trainer group resumes from it with the exact weights."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import ray
from safetensors.numpy import load_file

from actors.rank_stacks import stacks_to_log
from actors.trainer import TrainerFailure, TrainerGroup, TrainerRank
from rayrl.config import TrainerConfig
from rayrl.types import Sample
from tests.ray_support import wait_until_dead
from tests.shm_support import left_by_a_killed_owner

ROOT = Path(__file__).resolve().parents[2]


def _samples(n: int = 4) -> list[Sample]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(10, 4000, size=24).astype(np.int32)
        out.append(Sample(tokens=tokens, prompt_length=8, loss_mask=np.ones(16, np.int8),
                          rollout_logprobs=np.full(16, -8.0, np.float32), policy_versions=np.zeros(16, np.int32)))
    return out


def _weights(group: TrainerGroup, root: Path, version: int) -> dict[str, np.ndarray]:
    path = Path(group.export_weights(str(root), version, "float32"))
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    merged: dict[str, np.ndarray] = {}
    for f in files:
        merged.update(load_file(f))
    return merged


def _kill_and_wait(rank: ray.actor.ActorHandle) -> None:
    """Kill a rank and return once Ray reports it dead."""
    ray.kill(rank)
    wait_until_dead(rank)


# ~50 s, real ranks killed in each phase; fast: test_schedule_phases.py (what the pipeline does with a TrainerFailure:
# survivor checkpoint, fallback, resume line)
@pytest.mark.slow
def test_rank_death_in_any_phase_raises_and_a_survivor_checkpoint_resumes(ray_local, tiny_model_dir, tmp_path):
    """Rank 1 dies before a train step, then rank 0 before an onload: each call raises TrainerFailure naming
    its phase and the survivors' policy versions, and rank 2, the one survivor, writes a whole checkpoint
    that a fresh group (of two ranks) resumes from with the exact weights. The fresh ranks sweep the
    weight buffers a killed process left in /dev/shm as they start."""
    cfg = TrainerConfig(num_ranks=3, lr=1e-3, micro_batch_tokens=256)
    samples, advantages = _samples(6), [1.0, -1.0] * 3
    group = TrainerGroup(cfg, str(tiny_model_dir), seed=0, name_prefix="tf-a")
    try:
        assert group.train(samples, advantages)["policy_version"] == 1
        before = _weights(group, tmp_path / "w-before", 1)
        _kill_and_wait(group.ranks[1])
        with pytest.raises(TrainerFailure, match="in train: .*rank 1: ActorDiedError") as info:
            group.train(samples, advantages)
        assert info.value.phase == "train" and info.value.survivors == {0: 1, 2: 1}, info.value.errors  # nobody stepped

        _kill_and_wait(group.ranks[0])  # onload is instant on CPU: rank 0 must be gone before it is asked
        with pytest.raises(TrainerFailure, match="in onload: rank 0: ActorDiedError") as info:
            group.onload()
        assert info.value.survivors == {2: 1} and set(info.value.errors) == {0, 1}
        group.save_checkpoint(str(tmp_path / "ckpt"), from_rank=2)
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rank0.pt"]
    finally:
        group.shutdown()

    with left_by_a_killed_owner() as (buffer, weights):  # weight buffers of a rank killed with SIGKILL
        fresh = TrainerGroup(TrainerConfig(num_ranks=2, lr=1e-3, micro_batch_tokens=256), str(tiny_model_dir),
                             seed=0, name_prefix="tf-b")
        assert not buffer.exists() and not weights.exists()  # the new ranks swept them as they started
    try:
        assert fresh.load_checkpoint(str(tmp_path / "ckpt")) == 1
        after = _weights(fresh, tmp_path / "w-after", 1)
        assert before.keys() == after.keys()
        assert all(np.array_equal(before[k], after[k]) for k in before)  # the pre-failure weights, exactly
        assert fresh.train(samples, advantages)["policy_version"] == 2  # two ranks train on from it
    finally:
        fresh.shutdown()


def test_a_rank_that_cannot_start_is_a_trainer_failure_at_start(ray_local, tmp_path):
    """The ranks' set-up goes through TrainerGroup.gather like every other call: a rank that raises there (here
    its model directory holds no model) is a TrainerFailure in "start" naming the cause, which the driver turns
    into its one line and exit code 3, not a raw Ray error. (The Megatron backend on a machine without it fails
    the same way, MegatronUnavailable; that start costs a process group and Megatron's import, ~12 s more.)"""
    cfg = TrainerConfig(num_ranks=1, backend="torch", micro_batch_tokens=256)
    with pytest.raises(TrainerFailure, match="in start: rank 0: ValueError: Unrecognized model") as info:
        TrainerGroup(cfg, str(tmp_path), seed=0, name_prefix="tf-start")
    assert info.value.phase == "start" and list(info.value.errors) == [0]
    assert len(str(info.value)) < 500 < len(info.value.errors[0])  # one readable line; the whole cause is kept


def test_a_rank_whose_step_raises_frees_the_others_waiting_on_it_in_the_collective(ray_local, tiny_model_dir):
    """One rank's step raises before the gradients' all-reduce (here a token id past the vocabulary in its
    share of the batch); the other is already waiting on it inside the all-reduce, which on gloo would wait
    out the collective timeout. The failing rank leaves its process groups as it raises, so the other's
    collective fails at once: both answer, TrainerFailure names both causes and both ranks as survivors,
    and nobody is killed by the driver's grace. (The rank-death test above is the same cascade after a
    peer's death, where a surviving rank was seen waiting on the other survivor.)"""
    cfg = TrainerConfig(num_ranks=2, lr=1e-3, micro_batch_tokens=256)
    samples, advantages = _samples(4), [1.0, -1.0] * 2
    samples[0].tokens[3] = 10**6  # no such token: its rank's forward raises
    group = TrainerGroup(cfg, str(tiny_model_dir), seed=0, name_prefix="tf-leave")
    try:
        with pytest.raises(TrainerFailure, match="in train") as info:
            group.train(samples, advantages)
        errors = info.value.errors
        assert info.value.survivors == {0: 0, 1: 0}, errors
        assert sorted(errors) == [0, 1] and not any("no answer" in e for e in errors.values()), errors
        assert sum("IndexError" in e for e in errors.values()) == 1, errors
    finally:
        group.shutdown()


def test_a_rank_asked_for_its_stacks_writes_every_thread_to_its_log(ray_local):
    """Before the group kills a rank that gave no answer within the grace, the rank's process writes every
    thread's Python stack to its Ray log (found through its pid and node, as the group records them at start):
    where a stuck rank waited is then on record."""
    rank = TrainerRank.options(name="tf-stacks").remote("unused", TrainerConfig(num_ranks=1), 0, 1, 0)
    where = ray.get(rank.place.remote())
    log = Path(os.readlink(f"/proc/{where['pid']}/fd/2"))  # Ray sends the worker's stderr to its log file
    assert stacks_to_log(where["node_id"], where["pid"]) == f"its stacks are in its log (pid {where['pid']})"
    text = log.read_text()
    assert "most recent call first" in text and "ray/_private/worker.py" in text, text[-2000:]
    assert stacks_to_log(None, None) == "its stacks are unknown"  # a rank that never set up
    ray.kill(rank)


@pytest.mark.slow  # ~60 s: two pipelines
def test_pipeline_stops_with_a_checkpoint_and_resumes_the_failed_step(ray_local, tiny_model_dir, tmp_path, capsys):
    """A rank dies between steps: step 2 fails, the run stops with a checkpoint of step 1 that marks step 2's
    groups untrained and prints how to resume; the resumed run trains exactly those tasks as step 2."""
    import json

    from actors.pipeline import Pipeline
    from rayrl.config import load_config

    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"id": f"t-{i}", "prompt": f"What is {i} + 1?",
                                        "metadata": {"question": f"What is {i} + 1?", "answer": i + 1}}) + "\n"
                            for i in range(10)))
    overrides = [
        f"model.path={tiny_model_dir}", "exp_id=rankfail", f"logging.output_dir={tmp_path / 'runs'}",
        f"data.train_path={data}", "data.val_path=null", "data.shuffle=false", "engine.dtype=float32",
        "rollout.agent=tests.e2e_support:IndexedAgent", "rollout.reward=tests.e2e_support:index_parity_reward",
        "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_tokens=8", "rollout.max_turns=1", "rollout.few_shot_examples=0", "trainer.num_ranks=2",
        "trainer.steps=3", "sandbox_pool.min_warm=1", "logging.tensorboard=false", "logging.plot=false",
    ]
    cfg = load_config(ROOT / "examples" / "calculator" / "config.yaml", overrides)
    pipeline = Pipeline(cfg)
    try:
        pipeline.run_step()
        _kill_and_wait(pipeline.trainer.ranks[1])
        with pytest.raises(TrainerFailure):
            pipeline.run()
        out = capsys.readouterr().out
        assert "[rayrl] run stopped: trainer rank failure in train:" in out and "rank 1: ActorDiedError" in out
        assert out.count("run stopped") == 1
        assert f"--config {cfg.run_dir / 'config.yaml'} --resume" in out
        assert pipeline.checkpoints.store.steps() == [1]
        failed_step_tasks = sorted({json.loads(line)["task_id"] for line in
                                    (cfg.run_dir / "episodes" / "step000002.jsonl").read_text().splitlines()})
    finally:
        pipeline.shutdown()

    resumed = Pipeline(load_config(cfg.run_dir / "config.yaml"))
    try:
        assert resumed.resume() and resumed.step == 1
        resumed.run()
        step2 = sorted({json.loads(line)["task_id"] for line in
                        (cfg.run_dir / "episodes" / "step000002.jsonl").read_text().splitlines()})
        step3 = sorted({json.loads(line)["task_id"] for line in
                        (cfg.run_dir / "episodes" / "step000003.jsonl").read_text().splitlines()})
        assert step2 == failed_step_tasks == ["t-2", "t-3"]  # the failed step's tasks, trained once
        assert step3 == ["t-4", "t-5"]
    finally:
        resumed.shutdown()
