"""Judge rewards (rayrl/rewards/judge.py): a judge endpoint on loopback (tests/environments/judge_server.py)
grades episodes through the real openai SDK. Prompts and parse rules from the config or a function; calls
bounded in concurrency and time, retried on infrastructure errors; a judge that fails makes the episode an
infrastructure failure (judge_failed), never a reward of 0; tokens and latency reach the step metrics."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from rayrl.agents.base import AgentResult
from rayrl.config import ConfigError, JudgeConfig, RolloutConfig, load_config
from rayrl.resolve import load_checked
from rayrl.rewards import get_reward_fn, reward_fn_for
from rayrl.rewards.judge import Judge, judge_reward
from rayrl.rl.failures import INFRA_KINDS, JudgeError, is_scored
from rayrl.rl.step_metrics import judge_metrics
from rayrl.types import Episode, Task
from tests.environments.judge_server import JudgeServer

TASK = Task(prompt="What is the capital of France?", metadata={"answer": "Paris", "topic": "geography"},
            task_id="t1")


def cfg_for(server: JudgeServer, **kw) -> JudgeConfig:
    return JudgeConfig(**{"base_url": server.url, "model": "judge-1", "backoff_s": 0.01, "timeout_s": 5.0, **kw})


def answer(text: str) -> AgentResult:
    return AgentResult(final_answer=text, status="completed")


def test_the_judge_grades_with_the_configured_prompt_and_verdicts(judge_server, monkeypatch):
    server = judge_server(lambda prompt: "Yes." if "Answer to grade:\nParis" in prompt else "no")
    monkeypatch.setenv("JUDGE_KEY", "sk-judge")
    reward = judge_reward(cfg_for(server, api_key_env="JUDGE_KEY", system_prompt="Be strict."))
    right, wrong = answer("Paris"), answer("Lyon")
    assert reward(TASK, right) == 1.0 and reward(TASK, wrong) == 0.0
    sent = server.requests[0]
    assert sent["model"] == "judge-1" and sent["temperature"] == 0.0 and sent["max_tokens"] == 16
    assert sent["authorization"] == "Bearer sk-judge"
    assert sent["messages"][0] == {"role": "system", "content": "Be strict."}
    user = sent["messages"][1]["content"]
    assert "Question:\nWhat is the capital of France?" in user and "Reference answer:\nParis" in user
    (call,) = right.info["judge_calls"]
    assert call["ok"] and call["attempts"] == 1 and call["prompt_tokens"] > 0 and call["completion_tokens"] == 1


def test_a_score_pattern_and_metadata_fields(judge_server):
    server = judge_server(lambda prompt: "Reasoning... Score: 0.75")
    reward = judge_reward(cfg_for(server, prompt="Topic {topic}. Grade {response} for {question} ({missing})",
                                  score_pattern=r"Score: ([0-9.]+)"))
    assert reward(TASK, answer("Paris")) == 0.75
    assert server.requests[0]["messages"][0]["content"] == ("Topic geography. Grade Paris for What is the capital "
                                                            "of France? ({missing})")


def test_infrastructure_errors_are_retried_with_backoff(judge_server):
    server = judge_server()
    server.fail_first = 2
    result = answer("Paris")
    assert judge_reward(cfg_for(server, max_retries=3))(TASK, result) == 1.0
    assert len(server.requests) == 3 and result.info["judge_calls"][0]["attempts"] == 3


@pytest.mark.parametrize("status, attempts", [(503, 3), (429, 3), (400, 1), (401, 1)])
def test_a_judge_that_keeps_failing_raises_judge_error_after_its_retries(judge_server, status, attempts):
    server = judge_server()
    server.fail_first, server.fail_status = 100, status
    result = answer("Paris")
    with pytest.raises(JudgeError, match=f"after {attempts} attempt"):
        judge_reward(cfg_for(server, max_retries=2))(TASK, result)
    assert len(server.requests) == attempts and result.info["judge_calls"][0]["ok"] is False


def test_a_reply_no_rule_reads_is_a_judge_failure_not_a_zero(judge_server):
    server = judge_server(lambda prompt: "Well, it depends.")
    with pytest.raises(JudgeError, match="matches no parse rule: 'Well, it depends.'"):
        judge_reward(cfg_for(server))(TASK, answer("Paris"))


def test_a_slow_judge_is_cut_at_its_timeout(judge_server):
    server = judge_server()
    server.delay_s = 3.0
    t0 = time.monotonic()
    with pytest.raises(JudgeError, match="APITimeoutError"):
        judge_reward(cfg_for(server, timeout_s=0.3, max_retries=1))(TASK, answer("Paris"))
    assert time.monotonic() - t0 < 2.5  # two attempts of 0.3 s, not the server's 3 s


def test_concurrency_is_bounded(judge_server):
    server = judge_server()
    server.delay_s = 0.2
    reward = judge_reward(cfg_for(server, max_concurrent=2))
    threads = [threading.Thread(target=reward, args=(TASK, answer("Paris"))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(server.requests) == 6 and server.max_in_flight == 2


def test_a_function_decides_prompt_and_parsing(judge_server):
    server = judge_server(lambda prompt: "7/10")
    reward = judge_reward(cfg_for(server, function="tests.environments.judge_fns:out_of_ten"))
    assert reward(TASK, answer("Paris")) == 0.7
    assert server.requests[0]["messages"] == [{"role": "user", "content": "Rate 'Paris' out of 10."}]


def test_an_agent_that_failed_is_not_judged(judge_server):
    server = judge_server()
    assert judge_reward(cfg_for(server))(TASK, AgentResult(status="error", error="crashed")) == 0.0
    assert server.requests == []


def test_in_an_episode_a_failing_judge_is_an_infrastructure_failure(judge_server):
    from rayrl.agents.episode import EpisodeRunner
    server = judge_server()
    server.fail_first = 100
    rollout = RolloutConfig(reward="judge", judge=cfg_for(server, max_retries=1), episode_timeout_s=20)

    class Sessions:
        def open_session(self, metadata):
            from rayrl.gateway.sessions import SessionInfo

            return SessionInfo("s1", "tok", "http://127.0.0.1:9/v1")

        def session_stats(self, session_id):
            return {"api_calls": 1}

        def finish_session(self, session_id, reward, metadata=None):
            from rayrl.types import Sample

            return [Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0], loss_mask=[1], reward=reward)]

    from rayrl.agents.function_agent import FunctionAgent

    runner = EpisodeRunner(FunctionAgent(lambda task, endpoint: "Paris"), reward_fn_for(rollout), Sessions(), None,
                           rollout, "m")
    episode = runner.run(TASK, "g")
    assert episode.failure == "judge_failed" and episode.failure in INFRA_KINDS
    assert "the judge at" in episode.error and not is_scored(episode)  # kept out of the advantages
    assert episode.info["judge_calls"][0]["attempts"] == 2


def test_judge_metrics_sum_the_calls():
    ok = {"ok": True, "latency_s": 0.2, "queue_s": 0.0, "attempts": 1, "prompt_tokens": 30, "completion_tokens": 1}
    bad = {"ok": False, "latency_s": 1.0, "queue_s": 0.5, "attempts": 3, "prompt_tokens": 0, "completion_tokens": 0}
    eps = [Episode(session_id="a", task_id="t", group_id="g", info={"judge_calls": [ok, ok]}),
           Episode(session_id="b", task_id="t", group_id="g", info={"judge_calls": [bad]}),
           Episode(session_id="c", task_id="t", group_id="g")]
    m = judge_metrics(eps)
    assert m["judge/calls"] == 3 and m["judge/failed_calls"] == 1 and m["judge/prompt_tokens"] == 60
    assert m["judge/latency_s_mean"] == pytest.approx(0.2) and m["judge/attempts_mean"] == pytest.approx(5 / 3)
    assert judge_metrics(eps[2:]) == {}


@pytest.mark.parametrize("overrides, message", [
    (["rollout.reward=judge"], "rollout.judge.base_url: rollout.reward: judge needs"),
    (["rollout.reward=judge", "rollout.judge.base_url=localhost:8000"], "rollout.judge.base_url: an http(s)://"),
    (["rollout.reward=judge", "rollout.judge.base_url=http://x/v1"], "rollout.judge.model: name the model"),
    (["rollout.judge.score_pattern='Score [0-9]+'"], "rollout.judge.score_pattern: needs a group"),
    (["rollout.judge.score_pattern='Score ([0-9]+'"], "rollout.judge.score_pattern: not a regular expression"),
    (["rollout.judge.max_concurrent=0"], "rollout.judge.max_concurrent: must be > 0"),
])
def test_config_mistakes_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        load_checked(None, overrides)


def test_a_judge_function_with_the_wrong_signature_fails_at_load(judge_server):
    from rayrl.preflight import preflight

    server = judge_server()
    cfg = load_config(None, ["rollout.reward=judge", f"rollout.judge.base_url={server.url}", "rollout.judge.model=j",
                             "rollout.judge.function=tests.environments.judge_fns:two_arguments"])
    with pytest.raises(ConfigError, match=r"^rollout.judge.function: .*cannot be called as judge_fn\(task, result, "):
        preflight(cfg, data=False)
    with pytest.raises(ConfigError, match="reward_fn_for"):
        get_reward_fn("judge")
    assert dataclasses.is_dataclass(Judge(cfg.rollout.judge).cfg)


def test_the_judge_example_s_function_reads_the_number_and_compares_it(judge_server):
    """examples/judge/grade.py: the judge only reads the reply's number (this stand-in reads it with a regular
    expression, from the last message, which must be the policy's reply); the function compares it."""
    import re

    def reads_last_number(prompt: str) -> str:
        last = prompt.splitlines()[-1]
        return "Lots." if "shrug" in last else (re.findall(r"-?\d+", last) or ["none"])[-1]

    server = judge_server(reads_last_number)
    reward = judge_reward(cfg_for(server, function="examples.judge.grade:reads_the_answer"))
    task = Task(prompt="What is 6 * 7?", metadata={"answer": 42}, task_id="m1")
    assert reward(task, answer("The answer is 42.")) == 1.0
    assert reward(task, answer("6 * 7 = 43")) == 0.0
    assert reward(task, answer("I do not know")) == 0.0  # the judge says none: no answer, a 0
    assert reward(task, answer("")) == 0.0 and len(server.requests) == 3  # nothing to read: no call
    with pytest.raises(JudgeError, match="no number"):
        reward(task, answer("shrug"))  # the judge's own reply says nothing: no verdict, never a 0
    sent = server.requests[0]["messages"]
    assert sent[0]["role"] == "system" and sent[-1] == {"role": "user", "content": "The answer is 42."}
    assert [m["role"] for m in sent[1:-1]] == ["user", "assistant"] * 4  # the worked examples as turns
