"""The async and colocated_async schedules, two steps each, in a real local Ray on the tiny model.

Every component is real (CPU engine subprocess, gateway, sandboxes, rollout workers, trainer). The agent
does real sandbox work between its two LLM calls, so episodes are in flight while the trainer trains.
The engines run as the strict SGLang 0.5.9 stand-in (``--strict-sglang``, rayrl/engines/cpu/sglang_standin.py):
SGLang's own unpickler and bucket classes, the removed version route, the update lock, release only when
idle; the colocated run's trainer uses the CPU memory-saver stand-in, so a push after offload fails here.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import ray

from rayrl.config import load_config
from rayrl.engines.cpu.sglang_control import check_recorded_requests
from rayrl.resolve import resolve
from tests.pipeline.run_config import engine_version, pipeline_config, step_episodes
from tests.ray_support import scrape_metrics


def strict(tmp_path: Path) -> str:
    """The engines as the strict stand-in, recording every request they get under tmp_path/requests."""
    return f"engine.extra_args=[--strict-sglang,--record-requests,'{tmp_path / 'requests'}']"


def _assert_sglang_contract_kept(urls: list[str], tmp_path: Path, *sent: str) -> None:
    """Nothing the stand-in refused, no generation on half-updated weights, on lost weights or across
    versions unseen; and every request the pipeline sent, recorded, held again to SGLang 0.5.9's own route
    table and request classes (``sent``: ``"METHOD /path"`` calls that must be among them)."""
    for url in urls:
        with urllib.request.urlopen(f"{url}/server_info", timeout=10) as resp:
            contract = json.load(resp)["sglang_contract"]
        assert contract["version"] == "0.5.9" and contract["scheduler_died"] is None, contract
        assert contract["contract_violations"] == contract["mixed_weight_generations"] == 0, contract
        assert contract["unseen_version_spans"] == contract["lost_weight_generations"] == 0, contract
    calls, problems = check_recorded_requests(tmp_path / "requests")
    assert not problems, problems[:10]
    assert {"POST /generate", *sent} <= set(calls), sorted(calls)


def _trained_rows(cfg, step: int) -> list[dict]:
    """The step's rows of the groups that trained (those set aside as stale are written beside them)."""
    return [r for r in step_episodes(cfg, step) if not r.get("discarded")]


def _async_two_steps(tiny_model_dir, tmp_path, ray_local):
    """Two async steps, checked; returns the config, the checkpoint's untrained tasks and the trained ones."""
    from actors.pipeline import Pipeline

    # max_staleness 0 and 4 groups in flight for 2 per step: the groups started before the first weight
    # update hold version-0 tokens when step 2 (at version 1) takes them, so they must be dropped.
    cfg = pipeline_config(tmp_path, tiny_model_dir, "exp_id=async", "pipeline.schedule=async",
                          "pipeline.max_staleness=0", "pipeline.groups_in_flight=4", strict(tmp_path),
                          "trainer.weight_bucket_mb=4")  # several buckets per update
    assert resolve(cfg).algorithm.tis_cap == 2.0  # off-policy correction on by default in the async schedules
    pipeline = Pipeline(cfg)
    try:
        history = pipeline.run()
        assert len(history) == 2 and pipeline.version == 2
        assert all(engine_version(u) == "2" for u in pipeline.engine_urls)
        _assert_sglang_contract_kept(pipeline.engine_urls, tmp_path, "POST /update_weights_from_tensor",
                                     "POST /pause_generation", "POST /continue_generation")
        # each update with nothing generating: SGLang would otherwise wait for running generations and let
        # requests in between buckets run on half-updated weights (main pushed under traffic)
        logged = ray.get(pipeline.engines.slots[0].actor.control_log.remote())
        calls = [c for i, c in enumerate(logged) if i == 0 or c != logged[i - 1]]  # one entry per bucket run
        # after the pause, /flush_cache until it succeeds: no request left in the batch (issue 41 F)
        phase = ["pause_generation", "flush_cache", "update_weights_from_tensor", "continue_generation"]
        assert calls == phase * 2, calls
        assert history[1]["pipeline/dropped_stale_groups"] >= 1  # counted
        assert all(h["pipeline/staleness_max"] == 0 for h in history)  # nothing older was trained
        assert all(h["pipeline/stale_token_fraction"] == 0 for h in history)
        for step in (1, 2):
            rows = _trained_rows(cfg, step)
            assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
            assert len({(r["group_id"], r["index"]) for r in rows}) == 4
        # the dropped groups' episodes are recorded too, once, marked as set aside
        stale = [r for r in step_episodes(cfg, 2) if r.get("discarded")]
        assert len(stale) == 2 * history[1]["pipeline/dropped_stale_groups"]
        assert all(r["discarded"] == "stale" for r in stale)
        # the checkpoint holds every group not yet trained (queued, running, done): the dropped groups'
        # tasks were queued again, so nothing is lost
        saved = json.loads((Path(pipeline.checkpoints.latest()) / "pipeline.json").read_text())["schedule"]
        untrained = [g["task"]["task_id"] for g in saved["untrained_groups"]]
        assert saved["schedule"] == "async" and len(untrained) >= 2
        trained = [r["task_id"] for s in (1, 2) for r in _trained_rows(cfg, s)][::2]  # one row per group
        assert len(set(trained)) == 4 and not set(trained) & set(untrained)
        text = scrape_metrics(ray_local, ["ray_rayrl_sample_staleness_bucket", 'metric="pipeline/staleness_mean"'])
        assert "ray_rayrl_sample_staleness_bucket" in text and 'metric="pipeline/staleness_mean"' in text
    finally:
        pipeline.shutdown()
    return cfg, untrained, trained


@pytest.mark.slow  # ~2.5 min; fast: test_schedule_phases (async phase order, stale drops, resume)
def test_async_two_steps_drops_stale_groups(ray_local, tiny_model_dir, tmp_path):
    _async_two_steps(tiny_model_dir, tmp_path, ray_local)


@pytest.mark.slow  # ~40 s on top of the two steps (a second pipeline starts)
def test_async_resume_runs_the_checkpoints_untrained_groups_first(ray_local, tiny_model_dir, tmp_path):
    """In make test, tests/orchestration/test_schedule_phases.py holds the order of the untrained groups on resume after
    stale drops (no task trained twice, none skipped) and tests/pipeline/test_e2e_pipeline.py a real resume."""
    from actors.pipeline import Pipeline

    cfg, untrained, trained = _async_two_steps(tiny_model_dir, tmp_path, ray_local)
    # resume: the checkpoint's untrained groups run first; no task is trained twice, none skipped
    # (as many groups in flight as were saved, so step 3 can only take saved ones)
    resumed = Pipeline(load_config(cfg.run_dir / "config.yaml",
                                   ["trainer.steps=3", f"pipeline.groups_in_flight={len(untrained)}"]))
    try:
        assert resumed.resume() and resumed.step == 2 and resumed.version == 2
        assert [g.task.task_id for g in resumed.dispatcher.queue] == untrained
        resumed.run()
        step3 = [r["task_id"] for r in _trained_rows(cfg, 3)][::2]
        assert set(step3) <= set(untrained) and not set(step3) & set(trained)
    finally:
        resumed.shutdown()


@pytest.mark.slow  # ~50 s; fast: test_schedule_phases.py::test_colocated_async_follows_the_gpu_order
def test_colocated_async_two_steps_pauses_engines_in_order(ray_local, tiny_model_dir, tmp_path):
    from actors.pipeline import Pipeline

    cfg = pipeline_config(tmp_path, tiny_model_dir, "exp_id=colocated", "pipeline.schedule=colocated_async",
                          "pipeline.max_staleness=1", "pipeline.partial_rollout=true", strict(tmp_path),
                          "trainer.memory_saver_standin=true")
    pipeline = Pipeline(cfg)
    try:
        history = pipeline.run()
        assert len(history) == 2 and pipeline.version == 2
        assert all(engine_version(u) == "2" for u in pipeline.engine_urls)
        # the engine's own record of state-changing calls (weights come straight from the trainer rank)
        logged = ray.get(pipeline.engines.slots[0].actor.control_log.remote())
        calls = [c for i, c in enumerate(logged) if i == 0 or c != logged[i - 1]]  # one entry per bucket run
        # the engines give their memory to the trainer while it is built, and get it back once it is offloaded,
        # the trainer's weights pushed first (SGLang resumes released weights without their contents: issue 41 B)
        start = ["release_memory_occupation", "resume_memory_occupation", "update_weights_from_tensor",
                 "resume_memory_occupation"]
        # each step: idle (flush_cache succeeded) before the release; the weights come back first and are pushed
        # from the trainer's live memory before it is offloaded, then the KV cache (the stand-in makes offloaded
        # memory unusable: the old order failed); the checkpoint at the end takes the devices the same way (C)
        phase = ["pause_generation", "flush_cache", "release_memory_occupation", "resume_memory_occupation",
                 "update_weights_from_tensor", "resume_memory_occupation", "continue_generation"]
        assert calls == start + phase * 3, calls
        _assert_sglang_contract_kept(pipeline.engine_urls, tmp_path, "POST /release_memory_occupation",
                                     "POST /resume_memory_occupation", "POST /update_weights_from_tensor")
        assert all(h["pipeline/staleness_max"] <= 1 for h in history)
        # episodes kept doing sandbox work during training; their LLM calls waited at the gateway
        assert history[-1]["gateway/queued"] >= 1
        stats = pipeline.gateway.stats()
        assert all(s["router_queue_depth"] == 0 for s in stats)  # nothing left waiting after resume
        for step in (1, 2):
            assert all(r["status"] == "ok" for r in step_episodes(cfg, step))
    finally:
        pipeline.shutdown()


@pytest.mark.slow  # ~2 min; fast: test_schedule_phases.py::test_colocated_async_saves_and_loads_checkpoints_...
def test_colocated_async_resume_loads_into_the_onloaded_trainer(ray_local, tiny_model_dir, tmp_path):
    """Issue 41 C and D on the real parts: the colocated checkpoint is saved and, on --resume, loaded with the
    trainer onloaded (the memory stand-in makes every operation on offloaded trainer memory raise), and the
    engines (the strict stand-in, which loses released weights) serve the loaded version from the first
    rollout of the resumed run."""
    from actors.pipeline import Pipeline

    overrides = ["exp_id=colocated-resume", "pipeline.schedule=colocated_async", "pipeline.max_staleness=1",
                 "pipeline.partial_rollout=true", strict(tmp_path), "trainer.memory_saver_standin=true"]
    cfg = pipeline_config(tmp_path, tiny_model_dir, *overrides, "trainer.steps=1")
    pipeline = Pipeline(cfg)
    try:
        assert len(pipeline.run()) == 1 and pipeline.checkpoints.latest()
    finally:
        pipeline.shutdown()
    resumed = Pipeline(load_config(cfg.run_dir / "config.yaml", ["trainer.steps=2"]))
    try:
        assert resumed.resume() and (resumed.step, resumed.version) == (1, 1)
        assert all(engine_version(u) == "1" for u in resumed.engine_urls)  # pushed after the load
        history = resumed.run()
        assert len(history) == 1 and resumed.version == 2
        assert all(r["status"] == "ok" for r in step_episodes(cfg, 2))
        _assert_sglang_contract_kept(resumed.engine_urls, tmp_path, "POST /update_weights_from_tensor",
                                     "POST /release_memory_occupation", "POST /flush_cache")
    finally:
        resumed.shutdown()


@pytest.mark.slow  # ~60 s; tests/trainers/test_process_groups.py is the fast test of the release mechanism
def test_colocated_async_releases_the_broadcast_group_before_the_trainer_lends_its_gpu(ray_local, tiny_model_dir,
                                                                                     tmp_path):
    """Issue 25 point 6: with the distributed transport, the broadcast group (NCCL memory on a GPU) is
    destroyed after each push, before the engines get their KV cache back, and formed again at the next."""
    from actors.pipeline import Pipeline

    cfg = pipeline_config(tmp_path, tiny_model_dir, "exp_id=colocated-bcast", "pipeline.schedule=colocated_async",
                          "pipeline.max_staleness=1", "pipeline.weight_transfer=distributed", strict(tmp_path),
                          "trainer.memory_saver_standin=true")
    pipeline = Pipeline(cfg)
    try:
        history = pipeline.run()
        assert len(history) == 2 and pipeline.weights.transport == "distributed"
        assert all(engine_version(u) == "2" for u in pipeline.engine_urls)
        logged = ray.get(pipeline.engines.slots[0].actor.control_log.remote())
        calls = [c for i, c in enumerate(logged) if i == 0 or c != logged[i - 1]]
        # the group formed when the weight path connects at start goes too, before the trainer's first offload
        start = ["release_memory_occupation", "init_weights_update_group", "resume_memory_occupation",
                 "update_weights_from_distributed", "destroy_weights_update_group", "resume_memory_occupation"]
        phase = ["pause_generation", "flush_cache", "release_memory_occupation", "resume_memory_occupation",
                 "init_weights_update_group", "update_weights_from_distributed", "destroy_weights_update_group",
                 "resume_memory_occupation", "continue_generation"]
        assert calls == start + phase * 3, calls  # two steps, then the checkpoint at the end
        _assert_sglang_contract_kept(pipeline.engine_urls, tmp_path, "POST /init_weights_update_group",
                                     "POST /update_weights_from_distributed", "POST /destroy_weights_update_group")
    finally:
        pipeline.shutdown()


@pytest.mark.slow  # ~3 min; fast: tests/pipeline/test_e2e_pipeline.py (the sync schedule on the lenient CPU engine)
def test_sync_two_steps_on_the_strict_stand_in(ray_local, tiny_model_dir, tmp_path):
    """The sync schedule, every request it sends held to SGLang 0.5.9's own classes (recorded)."""
    from actors.pipeline import Pipeline

    cfg = pipeline_config(tmp_path, tiny_model_dir, "exp_id=sync-strict", "pipeline.schedule=sync", strict(tmp_path))
    pipeline = Pipeline(cfg)
    try:
        history = pipeline.run()
        assert len(history) == 2 and pipeline.version == 2
        assert all(engine_version(u) == "2" for u in pipeline.engine_urls)
        _assert_sglang_contract_kept(pipeline.engine_urls, tmp_path, "POST /update_weights_from_tensor",
                                     "GET /model_info")
        for step in (1, 2):
            assert all(r["status"] == "ok" for r in step_episodes(cfg, step))
    finally:
        pipeline.shutdown()
