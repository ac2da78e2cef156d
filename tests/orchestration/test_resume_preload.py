"""``--resume`` with the checkpoint loaded as the trainer starts (actors/pipeline.py, rayrl/orchestration/
run_checkpoint.py ``preload_checkpoint``): overlapped with the engines' start, then not loaded a second time;
driven with the schedule fakes (tests/orchestration/schedule_fakes.py), no Ray. The whole-pipeline twin:
tests/test_e2e_pipeline.py's resume (slow)."""

from __future__ import annotations

import dataclasses

from rayrl.orchestration.run_checkpoint import preload_checkpoint
from tests.orchestration.schedule_fakes import make_run
from tests.orchestration.test_schedule_phases import make_checkpoints, run_steps


def test_a_checkpoint_preloaded_as_the_trainer_started_is_not_loaded_again(tmp_path):
    """The resume restores the rest of the run from the preloaded step without loading the trainer a second
    time, and the weights still go to the engines. A preload of another step is loaded over."""
    run = make_run("pipeline.schedule=sync")
    run_steps(run, make_checkpoints(run, tmp_path), 2, save_every=2)
    resumed = make_run("pipeline.schedule=sync")
    checkpoints = make_checkpoints(resumed, tmp_path)
    preloaded = preload_checkpoint(resumed.trainer, checkpoints.store)
    assert preloaded is not None and (preloaded.step, preloaded.version) == (2, 2)
    assert resumed.log.count("trainer.load_checkpoint") == 1
    assert checkpoints.resume(preloaded)
    resumed.schedule.weights_loaded()
    assert resumed.log.count("trainer.load_checkpoint") == 1  # not loaded a second time
    assert (resumed.state.step, resumed.state.version) == (2, 2)
    assert resumed.log[-1].startswith("weights.push")  # the engines get the checkpoint's weights
    stale = make_run("pipeline.schedule=sync")
    assert make_checkpoints(stale, tmp_path).resume(dataclasses.replace(preloaded, step=1, version=1))
    assert stale.log.count("trainer.load_checkpoint") == 1 and stale.state.version == 2


def test_no_preload_without_a_checkpoint_or_where_a_rank_cannot_see_it(tmp_path):
    run = make_run("pipeline.schedule=sync")
    store = make_checkpoints(run, tmp_path).store
    assert preload_checkpoint(run.trainer, store) is None  # nothing saved yet: the resume starts fresh
    run_steps(run, make_checkpoints(run, tmp_path), 1)
    blind = make_run("pipeline.schedule=sync")
    blind.trainer.unseen_by = lambda path: [1]  # a rank on a node without the checkpoint directory
    assert preload_checkpoint(blind.trainer, store) is None and "trainer.load_checkpoint" not in blind.log
