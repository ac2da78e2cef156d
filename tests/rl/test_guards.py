"""The silent-failure guards (rayrl/rl/guards.py) on hand-built episodes: each guard's figure by hand, the
crossing line, warn / stop / off, thresholds and their validation, and the records' config fields.

Each guard also fires on episodes a real gateway recorded (tests/gateway/test_guards_gateway.py); the
stop path runs the real driver (tests/pipeline/test_guard_stop.py, slow)."""

from __future__ import annotations

import dataclasses

import pytest

from rayrl.config import AlgorithmConfig, ConfigError, GuardsConfig, load_config
from rayrl.rl.failures import REWARD_FAILED, SANDBOX_FAILED
from rayrl.rl.guards import (
    GUARDS,
    GUARDS_BY_NAME,
    GuardMonitor,
    GuardStop,
    StepView,
    check_guards,
    read_crossings,
    teacher_trains_equal_groups,
    write_crossings,
)
from rayrl.types import Episode


def ep(i: int, reward: float = 0.0, group: str = "g", failure: str | None = None, tool_errors: int = 0,
       **facts) -> Episode:
    """An episode as the runner leaves it; ``facts`` are what the gateway recorded (turns default 1)."""
    e = Episode(f"s{i}", f"t{i}", group, reward=reward)
    e.info = {"tool_errors": tool_errors, "gateway": {"turns": 1, "tool_calls": 0, "tool_turns": 1, **facts}}
    if failure:
        e.status, e.failure, e.error = "failed", failure, f"{failure}: planted"
    return e


def fired(episodes: list[Episode], cfg: GuardsConfig | None = None, max_turns: int = 4) -> dict[str, object]:
    report = check_guards(StepView(episodes, max_turns), cfg or GuardsConfig(), step=3, episodes_file="e.jsonl")
    return {c.guard: c for c in report.crossings}


def figure(name: str, episodes: list[Episode], max_turns: int = 4) -> float:
    guard = GUARDS_BY_NAME[name]
    report = check_guards(StepView(episodes, max_turns), GuardsConfig(), step=1)
    return report.metrics[f"guards/{guard.metric}"]


def healthy(n: int = 8) -> list[Episode]:
    """What a working tool-use step looks like: every episode called the calculator, rewards vary."""
    return [ep(i, reward=float(i % 2), group=f"g{i // 2}", tool_calls=1, turns=2, last_finish="stop")
            for i in range(n)]


def test_a_healthy_step_fires_nothing_and_logs_every_figure():
    report = check_guards(StepView(healthy(), 4), GuardsConfig(), step=1)
    assert report.crossings == [] and report.stop is None and report.summary() == ""
    assert {f"guards/{g.metric}" for g in GUARDS} <= set(report.metrics)
    assert report.metrics["guards/fired"] == 0.0
    assert report.metrics["guards/tool_call_rate"] == 1.0


def test_tool_calls_that_never_parse():
    episodes = [ep(i, tool_parse_errors=2, tool_calls=0) for i in range(2)] + healthy(2)
    # 4 unparsed of 4 + 2 parsed calls
    assert figure("tool_parse_errors", episodes) == pytest.approx(4 / 6)
    crossing = fired(episodes)["tool_parse_errors"]
    assert crossing.session_id == "s0" and crossing.count == 6
    assert "tool_parse_errors" not in fired(healthy(6) + [ep(9, tool_parse_errors=1)])  # 1 of 7


def test_an_agent_that_answers_without_its_tools_and_still_scores():
    episodes = [ep(i, reward=1.0, group=f"g{i}", tool_calls=0) for i in range(8)]
    assert figure("unused_tools", episodes) == 1.0
    got = fired(episodes)
    assert {"unused_tools", "tool_call_rate"} <= set(got)
    assert got["tool_call_rate"].line().startswith("[rayrl] guard tool_call_rate at step 3: 0.00 of 8 ")
    assert "below its threshold 0.02" in got["tool_call_rate"].line()
    # a task that declares no tools is none of these guards' business
    no_tools = [ep(i, reward=1.0, group=f"g{i}", tool_turns=0) for i in range(8)]
    assert not {"unused_tools", "tool_call_rate"} & set(fired(no_tools))


def test_tool_results_that_were_errors():
    episodes = [ep(i, tool_calls=2, tool_errors=2, reward=float(i % 2), group=f"g{i // 2}") for i in range(4)]
    assert figure("tool_errors", episodes) == 1.0
    assert "tool_errors" in fired(episodes)


def test_truncation_by_max_tokens_and_by_max_turns_and_the_reward_it_left():
    cut_tokens = [ep(i, length_turns=1, group=f"g{i}") for i in range(3)]
    cut_turns = [ep(3, turns=4, tool_calls=4, last_finish="tool_calls", group="g3")]  # every turn used, not done
    refused = [ep(4, turn_cap_refusals=1, tool_calls=1, group="g4")]
    fine = [ep(5, reward=1.0, turns=4, tool_calls=3, last_finish="stop", group="g5")]  # answered on its last turn
    episodes = cut_tokens + cut_turns + refused + fine
    assert figure("truncation", episodes) == pytest.approx(5 / 6)
    report = check_guards(StepView(episodes, 4), GuardsConfig(), step=1)
    assert report.metrics["guards/truncated_reward_share"] == 0.0  # the cut ones got none of the reward
    assert "truncation" in fired(episodes)
    assert figure("truncation", cut_turns, max_turns=5) == 0.0  # 4 turns of 5: not cut


def test_every_turn_spent_on_failing_tool_calls_is_stuck_not_cut():
    """The files example's step 3: 8 of 16 episodes used all 5 turns on tool calls that all failed (list_dir on
    a file path, a made-up tool name). More turns would not have helped them; tool_errors measures them, and
    truncation leaves them out. One working call among them and the episode was cut, not stuck."""
    stuck = [ep(i, turns=5, tool_calls=5, tool_errors=5, last_finish="tool_calls", group=f"g{i // 2}")
             for i in range(8)]
    answered = [ep(8 + i, turns=2, tool_calls=1, last_finish="stop", group=f"g{4 + i // 2}") for i in range(8)]
    assert figure("truncation", stuck + answered, max_turns=5) == 0.0
    assert "truncation" not in fired(stuck + answered, max_turns=5)
    working = [ep(i, turns=5, tool_calls=5, tool_errors=4, last_finish="tool_calls", group=f"g{i // 2}")
               for i in range(8)]
    assert figure("truncation", working + answered, max_turns=5) == 0.5
    assert figure("tool_errors", stuck + answered) == 40 / 48


def test_drift_from_a_template_that_drops_reasoning():
    episodes = [ep(i, drift=1, turns=2, tool_calls=1) for i in range(3)] + healthy(5)
    assert figure("drift", episodes) == pytest.approx(3 / 8)
    assert "drift" in fired(episodes)


def test_infrastructure_and_judge_failures():
    infra = [ep(i, failure=SANDBOX_FAILED) for i in range(3)] + healthy(5)
    assert figure("infra_failures", infra) == pytest.approx(3 / 8)
    assert fired(infra)["infra_failures"].session_id == "s0"
    judge = [ep(i, failure=REWARD_FAILED) for i in range(2)] + healthy(6)
    assert figure("reward_failures", judge) == pytest.approx(2 / 8)
    assert "reward_failures" in fired(judge)


def test_zero_variance_groups_and_the_reward_spread():
    equal = [ep(i, reward=0.1, group=f"g{i // 3}", tool_calls=1) for i in range(6)]  # two groups of 0.1
    report = check_guards(StepView(equal, 4), GuardsConfig(), step=1)
    assert report.metrics["guards/zero_variance_group_rate"] == 1.0
    assert report.metrics["guards/group_reward_std_mean"] == pytest.approx(0.0, abs=1e-12)
    assert "zero_variance_groups" in fired(equal)
    one_varied = equal + [ep(10, reward=0.0, group="g9", tool_calls=1), ep(11, reward=1.0, group="g9", tool_calls=1)]
    assert figure("zero_variance_groups", one_varied) == pytest.approx(2 / 3)
    assert "zero_variance_groups" not in fired(one_varied)
    # an infrastructure failure is not in its group's rewards
    with_infra = [ep(0, reward=1.0, group="a"), ep(1, reward=0.0, group="a", failure=SANDBOX_FAILED)]
    assert figure("zero_variance_groups", with_infra) == 1.0


def test_too_few_observations_give_no_verdict():
    three = [ep(i, tool_parse_errors=1) for i in range(3)]  # 3 attempts, the guard needs 4
    assert figure("tool_parse_errors", three) == 1.0 and "tool_parse_errors" not in fired(three)


def test_warn_stop_off_and_thresholds():
    episodes = [ep(i, failure=SANDBOX_FAILED) for i in range(4)]
    stop = GuardsConfig(infra_failures="stop")
    report = check_guards(StepView(episodes, 4), stop, step=2)
    assert report.stop is not None and report.stop.guard == "infra_failures"
    assert "stopping the run" in report.stop.line() and "guards: infra_failures" in report.summary()
    assert str(GuardStop(report.stop)) == report.stop.line()
    off = check_guards(StepView(episodes, 4), GuardsConfig(infra_failures="off"), step=2)
    assert "infra_failures" not in {c.guard for c in off.crossings}
    assert off.metrics["guards/infra_failure_rate"] == 1.0  # an off guard's figure is still logged
    assert "infra_failures" not in fired(episodes, GuardsConfig(infra_failures_max=1.0))
    warn = fired(episodes)["infra_failures"]
    assert warn.action == "warn" and "set guards.infra_failures: stop to stop on it" in warn.line()
    assert "e.g. episode s0 (task t0, e.jsonl, line 1)" in warn.line()


def test_every_guard_has_its_two_config_fields_and_nothing_else_is_there():
    names = {f.name for f in dataclasses.fields(GuardsConfig)}
    expected = {g.name for g in GUARDS} | {g.threshold_field for g in GUARDS}
    assert names == expected
    assert len(GUARDS_BY_NAME) == len(GUARDS)


def test_guard_config_is_validated_at_load():
    cfg = load_config(None, ["guards.drift=stop", "guards.truncation_max=0.9"])
    assert cfg.guards.drift == "stop" and cfg.guards.truncation_max == 0.9
    with pytest.raises(ConfigError, match="^guards.drift"):
        load_config(None, ["guards.drift=halt"])
    with pytest.raises(ConfigError, match=r"^guards.truncation_max: a share, must be in \[0, 1\], got 1.5"):
        load_config(None, ["guards.truncation_max=1.5"])
    with pytest.raises(ConfigError, match="^guards.nonsense"):
        load_config(None, ["guards.nonsense=warn"])


def test_crossings_are_written_for_the_inspector(tmp_path):
    report = check_guards(StepView([ep(i, failure=SANDBOX_FAILED) for i in range(4)], 4), GuardsConfig(), step=5,
                          episodes_file="runs/x/episodes/step000005.jsonl")
    write_crossings(tmp_path, report.crossings)
    write_crossings(tmp_path, [])
    (tmp_path / "guards.jsonl").open("a").write('{"half": ')  # a line cut by a crash is skipped
    rows = read_crossings(tmp_path)
    assert [(r["guard"], r["step"], r["session_id"], r["index"]) for r in rows] == [
        ("infra_failures", 5, "s0", 0), ("one_cause_failures", 5, "s0", 0)]  # all four failed the same way, too
    assert read_crossings(tmp_path / "missing") == []


def test_patience_a_model_learning_its_tool_format_is_not_broken():
    """tool_parse_errors waits 3 steps in a row: two bad steps then a good one fire nothing; three fire, and
    the line says for how long; a good step resets the count. Guards with patience 1 fire at once."""
    assert GUARDS_BY_NAME["tool_parse_errors"].patience == 3 and GUARDS_BY_NAME["infra_failures"].patience == 1
    bad = [ep(i, tool_parse_errors=1) for i in range(6)]
    monitor = GuardMonitor(GuardsConfig())
    seen = [[c.guard for c in monitor.check(StepView(v, 4), step=s).crossings]
            for s, v in enumerate([bad, bad, healthy(), bad, bad, bad, bad], 1)]
    assert seen == [[], [], [], [], [], ["tool_parse_errors"], ["tool_parse_errors"]]
    line = monitor.check(StepView(bad, 4), step=8).crossings[0].line()
    assert "above its threshold 0.5 for 5 steps in a row" in line
    infra = [ep(i, failure=SANDBOX_FAILED) for i in range(4)]
    assert [c.guard for c in GuardMonitor(GuardsConfig()).check(StepView(infra, 4), step=1).crossings] == [
        "infra_failures", "one_cause_failures"]  # one cause failed every episode: that guard has patience 1 too
    off = GuardMonitor(GuardsConfig(tool_parse_errors="off"))
    assert all(not off.check(StepView(bad, 4), step=s).crossings for s in range(1, 5))


def test_tool_errors_wait_five_steps_a_model_learning_its_tools_is_not_broken():
    """The files example's run (docs/guards.md, "On the shipped examples"): the untrained model calls
    list_dir on file paths and invents tool names, 0.87, 0.76, 1.00 of its calls erring in steps 1-3, then
    0.57 at step 4 and 0.26 at step 7 as it learns (reward 0.81). That must fire nothing; a tool that always
    errs (a missing binary, a sandbox without the files) still fires, at step 5."""
    assert GUARDS_BY_NAME["tool_errors"].patience == 5

    def step(errors: int) -> list[Episode]:  # 8 episodes of 4 calls each, `errors` of the 32 erring
        return [ep(i, reward=float(i % 2), group=f"g{i // 2}", tool_calls=4, turns=5,
                   tool_errors=min(4, max(0, errors - 4 * i))) for i in range(8)]

    learning = GuardMonitor(GuardsConfig())
    rates = [28, 25, 32, 18, 20, 13, 8]  # 0.88, 0.78, 1.00, 0.56, 0.62, 0.41, 0.25 of 32 calls
    assert [figure("tool_errors", step(n)) for n in rates[:3]] == [28 / 32, 25 / 32, 1.0]
    assert all(not learning.check(StepView(step(n), 5), step=s).crossings for s, n in enumerate(rates, 1))
    broken = GuardMonitor(GuardsConfig())
    seen = [[c.guard for c in broken.check(StepView(step(32), 5), step=s).crossings] for s in range(1, 7)]
    assert seen == [[], [], [], [], ["tool_errors"], ["tool_errors"]]


def test_zero_variance_groups_under_distillation_train_on_the_teacher():
    """With a distillation teacher every sample trains on its per-token reverse KL whatever its group's
    rewards (examples/distill: the task reward never enters an advantage), so equal-reward groups are not
    groups that train nothing: the share is 0 and the guard stays quiet; the reward spread is still logged."""
    unsolved = [ep(i, reward=0.0, group=f"g{i // 4}", tool_calls=1, turns=2) for i in range(8)]
    assert figure("zero_variance_groups", unsolved) == 1.0 and "zero_variance_groups" in fired(unsolved)
    report = check_guards(StepView(unsolved, 4, per_token_term=True), GuardsConfig(), step=5)
    assert report.metrics["guards/zero_variance_group_rate"] == 0.0
    assert report.metrics["guards/group_reward_std_mean"] == 0.0
    assert not report.crossings
    # what the pipeline passes: a teacher with a coefficient, and no dynamic sampling (that drops such groups)
    algo = AlgorithmConfig(distill_teacher="/models/teacher", distill_coef=1.0)
    assert teacher_trains_equal_groups(algo, has_teacher=True)
    assert not teacher_trains_equal_groups(algo, has_teacher=False)
    assert not teacher_trains_equal_groups(dataclasses.replace(algo, dynamic_sampling=True), has_teacher=True)
    assert not teacher_trains_equal_groups(dataclasses.replace(algo, distill_coef=0.0), has_teacher=True)
