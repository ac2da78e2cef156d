"""verifiers environments run unchanged against the gateway (rayrl/environments/verifiers_env.py), with the
real verifiers package (0.3.x, its classic API) and real episodes: the environment's own rollout sends its
calls through the gateway to a scripted engine, EpisodeRunner scores them with the environment's rubric."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rayrl.agents import agent_factory
from rayrl.agents.episode import EpisodeRunner
from rayrl.config import ConfigError, RolloutConfig, load_config
from rayrl.environments.verifiers_env import load_splits
from rayrl.preflight import preflight
from rayrl.rewards import get_reward_fn
from tests.gateway.episode_kit import InProcessSessions

pytest.importorskip("verifiers")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "verifiers" / "config.yaml"
SUMS = "examples.verifiers.sums_env:load_environment"


def sums_script(prompt: str) -> str:
    a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1])
    return str(a + b) if a % 2 == 0 else f"It is {a + b + 1}."  # odd first operands: wrong and badly formatted


def episodes(stack, environment: str = SUMS, args: dict | None = None, n: int = 6, **rollout):
    rollout = {"max_tokens": 16, **rollout}
    cfg = RolloutConfig(environment=f"verifiers:{environment}", episode_timeout_s=30,
                        environment_args={"num_train": n} if args is None else args, **rollout)
    train, _ = load_splits(environment, dict(cfg.environment_args))
    runner = EpisodeRunner(agent_factory(cfg)(), get_reward_fn(cfg.reward), InProcessSessions(stack), None, cfg,
                           "tiny")
    return [runner.run(train[i], f"g{i}") for i in range(min(n, len(train)))], train


def test_the_environment_rollout_runs_through_the_gateway_and_its_rubric_scores_it(scripted):
    stack = scripted(sums_script)
    eps, train = episodes(stack)
    for e, task in zip(eps, train.tasks):
        assert e.ok, e.error
        a = int(re.findall(r"What is (\d+)", task.prompt)[0])
        right = a % 2 == 0
        # each reward function's own score, and the metrics verifiers' monitor rubric adds (weight 0)
        assert e.info["reward_breakdown"] == {"correct_answer": float(right), "answer_format": float(right),
                                              "num_turns": 1.0}
        assert e.reward == pytest.approx(1.2 if right else 0.0)  # weights 1.0 and 0.2
        assert e.samples and e.samples[0].reward == e.reward  # the gateway recorded the call, token for token
    # the environment's system prompt and question reached the engine through the chat template
    assert "Answer with the number only." in stack.engine.prompts[0] and "What is" in stack.engine.prompts[0]


def test_sampling_settings_reach_the_engine_and_the_environment_s_own_win(scripted):
    stack = scripted(sums_script)
    episodes(stack, n=1, temperature=0.5, top_p=0.9)
    assert stack.engine.sampling[-1]["temperature"] == 0.5 and stack.engine.sampling[-1]["top_p"] == 0.9
    assert stack.engine.sampling[-1]["max_new_tokens"] == 16
    episodes(stack, args={"num_train": 1, "temperature": 0.25}, n=1, temperature=0.5)  # the env sets its own
    assert stack.engine.sampling[-1]["temperature"] == 0.25


def test_a_reward_function_that_raises_fails_the_scoring_with_its_cause(scripted):
    stack = scripted(sums_script)
    eps, _ = episodes(stack, environment="tests.environments.vf_envs:raising_rubric", args={}, n=2)
    for e in eps:
        assert e.failure == "reward_failed" and e.reward == 0.0
        assert "always_raises raised ZeroDivisionError" in e.error, e.error


def test_a_multi_turn_environment_runs_its_own_loop(scripted):
    stack = scripted(lambda prompt: "4" if prompt.count("<|im_start|>user") == 1 else "Yes, 4.")
    eps, _ = episodes(stack, environment="tests.environments.vf_envs:double_check", args={}, n=2)
    for e in eps:
        assert e.ok, e.error
        assert e.info["turns"] == 2 and e.reward == 1.0  # both turns answered, both through the gateway
        assert len(e.samples) >= 1 and sum(len(s.loss_mask) for s in e.samples) > 0


def test_a_tool_environment_calls_its_tools(scripted):
    def script(prompt: str) -> str:
        if "<|im_start|>tool" in prompt or "tool_response" in prompt:
            return "The sum is 12."
        return '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 7}}\n</tool_call>'

    stack = scripted(script)
    eps, _ = episodes(stack, environment="tests.environments.vf_envs:tool_sum", args={}, n=1, max_tokens=64)
    (e,) = eps
    assert e.ok, e.error
    assert e.info["tool_calls"] == 1 and e.reward == 1.0 and e.info["reward_breakdown"]["used_the_tool"] == 1.0


def test_a_judge_rubric_asks_rayrl_s_judge(scripted, judge_server):
    from rayrl.config import JudgeConfig

    stack, judge = scripted(sums_script), judge_server(lambda prompt: "yes" if "Response:\n```\n2\n```" in prompt
                                                      else "no")
    eps, train = episodes(stack, environment="tests.environments.vf_envs:judged", args={}, n=2,
                          judge=JudgeConfig(base_url=judge.url, model="judge-1", backoff_s=0.01))
    assert [e.reward for e in eps] == [1.0, 0.0] and all(e.ok for e in eps)  # "0 + 2" answered 2; "1 + 2" wrongly
    assert [r["model"] for r in judge.requests] == ["judge-1", "judge-1"]  # not the environment's own model
    assert all(e.info["judge_calls"][0]["ok"] for e in eps)


def test_a_judge_rubric_whose_judge_is_down_is_an_infrastructure_failure(scripted):
    eps, _ = episodes(scripted(sums_script), environment="tests.environments.vf_envs:judged", args={}, n=1)
    (e,) = eps
    assert e.failure == "judge_failed" and "judge_says_yes raised" in e.error, e.error


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.environment=verifiers:no-such-env-44"],
         "rollout.environment: no installed verifiers environment 'no-such-env-44'"),
        (["rollout.environment=verfiers:x"], "rollout.environment: unknown environment kind 'verfiers' (did you mean "
                                             "'verifiers'?)"),
        (["rollout.environment=reverse-text"], "rollout.environment: expected <kind>:<environment>"),
        (["rollout.environment=verifiers:tests.environments.vf_envs:from_the_hub"],
         "rollout.environment: tests.environments.vf_envs:from_the_hub loads its data from the Hugging Face Hub"),
        (["rollout.environment=verifiers:tests.environments.vf_envs:broken_loader"],
         "rollout.environment: loading tests.environments.vf_envs:broken_loader failed: KeyError: 'needs_an_api_key'"),
        (["rollout.environment=verifiers:tests.environments.vf_envs:not_an_env"],
         "rollout.environment: tests.environments.vf_envs:not_an_env gave a dict, not a verifiers Environment"),
        (["rollout.environment=verifiers:tests.environments.vf_envs:group_scored"],
         "rollout.environment: tests.environments.vf_envs:group_scored's rubric scores whole groups"),
        (["rollout.environment_args={num_trian: 3}"],
         "rollout.environment_args: examples.verifiers.sums_env:load_environment's load_environment: got an "
         "unexpected keyword argument 'num_trian'"),
        (["rollout.agent=chat"], "rollout.agent: rollout.environment runs the episodes"),
        (["rollout.reward=gsm8k"], "rollout.reward: rollout.environment runs the episodes"),
        (["data.val_path=x.jsonl"], "rollout.environment: the environment's datasets are the tasks"),
    ],
)
def test_each_mistake_fails_at_load_naming_the_field(overrides, message):
    cfg = load_config(EXAMPLE, overrides) if "num_trian" in str(overrides) else None
    with pytest.raises(ConfigError) as info:
        if cfg is None:  # the example's arguments are for its own environment
            cfg = load_config(EXAMPLE, overrides)
            if cfg.rollout.environment != load_config(EXAMPLE).rollout.environment:
                cfg.rollout.environment_args = {}
        preflight(cfg)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    import sys

    from rayrl.environments import verifiers_env

    monkeypatch.setattr(verifiers_env, "_LOADED", {})
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(ConfigError, match=r"^rollout.environment: needs the verifiers package .*rayrl\[verifiers\]"):
        load_splits("some-env", {})


def test_the_example_passes_preflight_and_has_a_held_out_set():
    cfg = load_config(EXAMPLE)
    preflight(cfg)
    assert cfg.rollout.agent == "environment" and cfg.rollout.reward == "environment"
    train, val = load_splits(cfg.rollout.environment.split(":", 1)[1], dict(cfg.rollout.environment_args))
    assert len(train) == cfg.rollout.environment_args["num_train"] and val is not None and len(val) > 0


def test_the_driver_exits_2_before_ray_for_an_unknown_environment(capsys):
    from tests.test_driver_cli import assert_one_line_exit_2, run_main

    out = run_main(capsys, f"--config={EXAMPLE}", "rollout.environment=verifiers:no-such-env-44",
                   "rollout.environment_args={}")
    assert_one_line_exit_2(out, "config error: rollout.environment: no installed verifiers environment "
                                "'no-such-env-44'")
