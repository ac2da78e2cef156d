"""reasoning-gym datasets as tasks (rayrl/data/reasoning_gym.py): the weighted mixture, held-out sets from
other seeds, the datasets' own score_answer as the reward, and every mistake a ConfigError naming the field.
The real reasoning-gym package generates and scores everything here."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

from rayrl.agents.base import AgentResult
from rayrl.config import ConfigError, ReasoningGymSource, load_config
from rayrl.data.dataset import TaskSampler
from rayrl.data.reasoning_gym import ReasoningGymTasks, extract_answer, load_splits, strict_answer
from rayrl.preflight import preflight
from rayrl.rewards import get_reward_fn

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reasoning_gym" / "config.yaml"
SUMS = {"min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 3}


def source(name: str = "chain_sum", **kw) -> ReasoningGymSource:
    return ReasoningGymSource(name=name, **{"config": dict(SUMS) if name == "chain_sum" else {}, **kw})


def dataset_of(task) -> str:
    return task.metadata["reasoning_gym"]["dataset"]


def test_questions_are_prompts_and_the_entry_rides_along():
    import reasoning_gym

    tasks = ReasoningGymTasks([source(size=5, seed=3)])
    same = reasoning_gym.create_dataset("chain_sum", size=5, seed=3, **SUMS)
    assert [t.prompt for t in tasks.tasks] == [same[i]["question"] for i in range(5)]
    assert tasks[2].metadata["reasoning_gym"]["entry"]["answer"] == same[2]["answer"]
    assert len({t.task_id for t in tasks.tasks}) == 5


def test_weights_set_each_dataset_share_of_the_draws_at_every_epoch():
    tasks = ReasoningGymTasks([source(size=10, seed=1, weight=3.0), source("leg_counting", size=40, weight=1.0)])
    sampler = TaskSampler(tasks, seed=5)
    for _ in range(3):  # an epoch is len(tasks) = 50 draws: 37.5 and 12.5 by weight, rounded
        counts = collections.Counter(dataset_of(t) for t in sampler.next(50))
        assert counts in ({"chain_sum": 38, "leg_counting": 12}, {"chain_sum": 37, "leg_counting": 13}), counts
    # the small dataset repeats within an epoch, but walks its own permutation: all 10 before any repeats
    draws = [t.task_id for t in TaskSampler(tasks, seed=5).next(50) if dataset_of(t) == "chain_sum"]
    assert len(set(draws[:10])) == 10 and len(set(draws)) == 10
    # the large one, drawn 12-13 times an epoch, carries on where the last epoch stopped: no repeat in 3 epochs
    draws = [t.task_id for t in TaskSampler(tasks, seed=5).next(150) if dataset_of(t) == "leg_counting"]
    assert len(draws) in (36, 37, 38, 39) and len(set(draws)) == len(draws)


def test_without_weights_each_task_is_drawn_once_per_epoch():
    tasks = ReasoningGymTasks([source(size=7), source("leg_counting", size=5)])
    ids = [t.task_id for t in TaskSampler(tasks, seed=0).next(12)]
    assert sorted(ids) == sorted(t.task_id for t in tasks.tasks)


def test_a_resumed_sampler_continues_the_same_draws():
    tasks = ReasoningGymTasks([source(size=6, weight=1.0), source("leg_counting", size=9, weight=2.0)])
    first = TaskSampler(tasks, seed=2)
    first.next(23)  # into the second epoch
    resumed = TaskSampler(tasks, seed=2)
    resumed.load_state_dict(first.state_dict())
    assert [t.task_id for t in resumed.next(40)] == [t.task_id for t in first.next(40)]


def test_held_out_tasks_come_from_another_seed_without_training_questions():
    train, val = load_splits([source(size=30, seed=4, val_size=20)])
    assert val is not None and len(val) + val.dropped == 20
    assert not train.questions() & val.questions()
    assert all("-val" in t.task_id for t in val.tasks)
    # a generator with few distinct questions: the repeated ones are dropped, counted
    tiny = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    train, val = load_splits([ReasoningGymSource(name="chain_sum", size=300, config=tiny, val_size=50)])
    assert val is None or (val.dropped > 0 and not train.questions() & val.questions())


def test_no_held_out_set_without_val_size():
    assert load_splits([source(size=3)])[1] is None


def test_the_reward_is_the_datasets_own_score_answer():
    reward = get_reward_fn("reasoning_gym")
    task = ReasoningGymTasks([source(size=1, seed=9)])[0]
    answer = task.metadata["reasoning_gym"]["entry"]["answer"]
    assert reward(task, AgentResult(final_answer=f"Let me add.\n<answer> {answer} </answer>")) == 1.0
    assert reward(task, AgentResult(final_answer=answer)) == 0.0  # no tags: reasoning-gym's own rule scores 0
    assert reward(task, AgentResult(final_answer=f"<ANSWER>{answer}</ANSWER>")) == 0.0  # its tags are lower case
    lenient = get_reward_fn("reasoning_gym_lenient")
    assert lenient(task, AgentResult(final_answer=answer)) == 1.0  # no tags: the whole reply
    assert lenient(task, AgentResult(final_answer=f"<ANSWER>{answer}</ANSWER>")) == 1.0
    assert 0.0 < lenient(task, AgentResult(final_answer=f"The sum is {answer}.")) < 1.0  # partial credit
    assert reward(task, AgentResult(final_answer=f"<answer>{int(answer) + 1}</answer>")) == 0.0
    assert reward(task, AgentResult(final_answer=f"<answer>{answer}</answer>", status="error")) == 0.0
    # a dataset whose score gives partial credit keeps it
    spell = ReasoningGymTasks([ReasoningGymSource(name="spell_backward", size=1, seed=1)])[0]
    word = spell.metadata["reasoning_gym"]["entry"]["answer"]
    assert reward(spell, AgentResult(final_answer=f"<answer>{word}</answer>")) == 1.0


def test_extract_answer_takes_the_last_tagged_answer():
    assert extract_answer("<answer>1</answer> then <ANSWER>\n2\n</ANSWER>") == "2"
    assert extract_answer(None) == "" and extract_answer("  7 ") == "7"
    assert strict_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert strict_answer("7") is None and strict_answer(None) is None and strict_answer("<ANSWER>7</ANSWER>") is None


def test_a_task_from_elsewhere_is_refused_by_the_reward():
    from rayrl.types import Task

    with pytest.raises(ValueError, match="not a reasoning-gym task"):
        get_reward_fn("reasoning_gym")(Task(prompt="p", metadata={}, task_id="x"), AgentResult(final_answer="1"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.reasoning_gym=[{name: chain_sun}]"],
         "data.reasoning_gym[0].name: no reasoning-gym dataset 'chain_sun' (did you mean 'chain_sum'?)"),
        (["data.reasoning_gym=[{name: chain_sum, config: {max_termz: 3}}]"],
         "data.reasoning_gym[0].config: chain_sum rejects these options:"),
        (["data.reasoning_gym=[{name: chain_sum, config: {min_terms: 5, max_terms: 2}}]"],
         "data.reasoning_gym[0].config: chain_sum rejects these options:"),
        (["data.reasoning_gym=[{name: chain_sum}, {name: chain_sum, size: 0}]"],
         "data.reasoning_gym[1].size: must be >= 1, got 0"),
        (["data.reasoning_gym=[{name: chain_sum, seed: 3, val_seed: 3}]"],
         "data.reasoning_gym[0].val_seed: equals seed (3)"),
        (["data.reasoning_gym=[{name: chain_sum, weight: 0}]"], "data.reasoning_gym[0].weight: must be > 0"),
        (["data.reasoning_gym=[{name: chain_sum, config: {seed: 1}}]"],
         "data.reasoning_gym[0].config.seed: set data.reasoning_gym[0].seed instead"),
        (["data.reasoning_gym=[{name: chain_sum, val_size: 4}]", "data.val_path=x.jsonl"], "data.val_path:"),
        (["data.reasoning_gym=[{name: chain_sum}]", "pipeline.eval_interval=2"], "pipeline.eval_interval:"),
    ],
)
def test_each_mistake_names_its_field_on_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        preflight(load_config(EXAMPLE, ["pipeline.eval_interval=0", *overrides]))
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"^data.reasoning_gym: needs the reasoning-gym package .*reasoning-gym\]"):
        preflight(load_config(EXAMPLE))


def test_an_override_reaches_one_entry_of_the_list():
    cfg = load_config(EXAMPLE, ["data.reasoning_gym[1].size=7", "data.reasoning_gym[0].config.max_digits=3"])
    assert cfg.data.reasoning_gym[1].size == 7 and cfg.data.reasoning_gym[0].config["max_digits"] == 3
    assert cfg.data.reasoning_gym[0].size == 1000
    with pytest.raises(ConfigError, match=r"^data.reasoning_gym\[1\].size: Value 'x'"):
        load_config(EXAMPLE, ["data.reasoning_gym[1].size=x"])


def test_the_example_loads_and_passes_preflight():
    cfg = load_config(EXAMPLE)
    preflight(cfg)
    assert cfg.rollout.agent == "chat" and cfg.data.has_val()


def test_the_driver_exits_2_before_ray_for_an_unknown_name(capsys):
    from tests.test_driver_cli import assert_one_line_exit_2, run_main

    out = run_main(capsys, f"--config={EXAMPLE}", "data.reasoning_gym=[{name: no_such_task, val_size: 2}]")
    assert_one_line_exit_2(out, "config error: data.reasoning_gym[0].name: no reasoning-gym dataset 'no_such_task'")

