"""A judge the run serves (``rollout.judge.serve``): rayrl/gateway/frozen.py's endpoint in front of a real CPU
engine server of a tiny random model, asked over real HTTP on loopback by rayrl's Judge through the openai SDK,
with the config the rollout workers get (served_judge_config). No Ray: actors/judge_server.py only starts and
places these pieces; its run is in tests/pipeline/test_environment_runs.py (slow suite)."""

from __future__ import annotations

import re

import pytest

from rayrl.agents.base import AgentResult
from rayrl.config import ConfigError, JudgeConfig, load_config
from rayrl.engines.cpu.engine import CPUEngine
from rayrl.gateway.frozen import FrozenEndpoint
from rayrl.ports import free_port
from rayrl.resolve import load_checked
from rayrl.rewards.judge import Judge, judge_reward, served_judge_config
from rayrl.rl.failures import JudgeError
from rayrl.types import Task
from tests.engines._engine_kit import ServerThread
from tests.loop_support import LoopThread

QUESTION = [{"role": "user", "content": "Is 2 + 2 equal to 4? Reply yes or no."}]


@pytest.fixture(scope="module")
def judge_stack(tiny_model_dir):
    """The judge's engine (a real HTTP engine server) and the endpoint in front of it, on loopback."""
    engine = CPUEngine(tiny_model_dir, dtype="float32", max_batch_size=8, weight_version="0").start()
    server = ServerThread(engine)
    loop = LoopThread()
    endpoint = FrozenEndpoint(str(tiny_model_dir), [server.url], model_name="the-judge", context_length=1024)
    url = loop.run(endpoint.start())
    yield engine, endpoint, url
    loop.run(endpoint.stop())
    loop.close()
    server.close()
    engine.shutdown()


def served(url: str, model_dir, **kw) -> JudgeConfig:
    """``rollout.judge`` as the workers get it once the run serves ``model_dir`` at ``url``."""
    return served_judge_config(JudgeConfig(serve=str(model_dir), backoff_s=0.01, timeout_s=30.0, **kw), url)


def greedy_reply(engine: CPUEngine, tokenizer, messages, max_tokens: int) -> tuple[str, int, int]:
    """What the judge model itself answers (text, prompt tokens, completion tokens): its chat template, greedy,
    straight from the engine."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    res = engine.generate(ids, {"temperature": 0.0, "max_new_tokens": max_tokens}, timeout=60)
    return tokenizer.decode(res.output_ids, skip_special_tokens=True), len(ids), len(res.output_ids)


def test_the_served_judge_answers_as_its_model_and_records_nothing(judge_stack, tiny_model_dir, tiny_tokenizer):
    engine, endpoint, url = judge_stack
    cfg = served(url, tiny_model_dir, max_tokens=6)
    assert (cfg.base_url, cfg.model, cfg.serve, cfg.api_key_env) == (url, str(tiny_model_dir), None, None)
    want, prompt_tokens, completion_tokens = greedy_reply(engine, tiny_tokenizer, QUESTION, 6)
    before = endpoint.stats()
    text, resp = Judge(cfg).complete(QUESTION)
    assert text == want and resp.model == str(tiny_model_dir)  # the judge model's own answer, under its name
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    for _ in range(3):  # a run-long stream of calls, whatever key they send
        assert Judge(cfg).ask(QUESTION) == want
    session = endpoint.gateway.unrecorded
    assert endpoint.stats()["calls"] - before["calls"] == 4 and session.api_calls >= 4
    # nothing of the judge is kept, to train on or to grow: no turn, no session
    assert session.tree.stats()["turns"] == 0 and not session.recent
    assert endpoint.gateway.sessions.open_sessions == 0 and endpoint.gateway.sessions.opened == 0


def test_the_judge_reward_grades_through_the_served_judge(judge_stack, tiny_model_dir, tiny_tokenizer):
    """A random model's reply is no verdict word, so a judge function grades by the reply's length
    (tests/environments/judge_fns.py); the call goes through the served endpoint like every judge call."""
    engine, endpoint, url = judge_stack
    cfg = served(url, tiny_model_dir, max_tokens=5, function="tests.environments.judge_fns:by_reply_length")
    reply, prompt_tokens, completion_tokens = greedy_reply(
        engine, tiny_tokenizer, [{"role": "user", "content": "Is '42' right?"}], 5)
    result = AgentResult(final_answer="42", status="completed")
    before = endpoint.stats()["calls"]
    assert judge_reward(cfg)(Task(prompt="What is 6 x 7?", task_id="t1"), result) == float(len(reply) % 2)
    (call,) = result.info["judge_calls"]
    assert call["ok"] and (call["prompt_tokens"], call["completion_tokens"]) == (prompt_tokens, completion_tokens)
    assert endpoint.stats()["calls"] == before + 1


def test_a_judge_whose_engine_is_gone_is_an_infrastructure_failure(tiny_model_dir):
    loop = LoopThread()
    endpoint = FrozenEndpoint(str(tiny_model_dir), [f"http://127.0.0.1:{free_port()}"], model_name="the-judge",
                              context_length=1024, wait_timeout_s=2.0)
    try:
        url = loop.run(endpoint.start())
        result = AgentResult(final_answer="42", status="completed")
        with pytest.raises(JudgeError, match=r"after 2 attempt\(s\): HTTP 50[23]"):
            judge_reward(served(url, tiny_model_dir, max_retries=1))(Task(prompt="q", task_id="t"), result)
        assert result.info["judge_calls"][0]["ok"] is False
    finally:
        loop.run(endpoint.stop())
        loop.close()


@pytest.mark.parametrize("overrides, message", [
    (["rollout.judge.serve=/m", "rollout.judge.base_url=http://x/v1", "rollout.judge.model=j"],
     "rollout.judge.serve: the run serves this judge itself, so rollout.judge.base_url must be unset"),
    (["rollout.judge.serve=''"], "rollout.judge.serve: must not be empty"),
    (["rollout.judge.serve=http://x/v1"], "rollout.judge.serve: a model path or name the run serves, got the URL"),
    (["rollout.reward=judge", "rollout.judge.serve=/m", "rollout.judge.api_key_env=KEY"],
     "rollout.judge.api_key_env: the judge the run serves"),
    (["rollout.judge.num_engines=2"], "rollout.judge.num_engines: only read with rollout.judge.serve"),
    (["rollout.reward=judge", "rollout.judge.serve=/m", "rollout.judge.num_engines=0"],
     "rollout.judge.num_engines: must be > 0"),
    (["rollout.judge.serve=/m"], "rollout.judge.serve: nothing asks the judge"),
    (["rollout.reward=judge", "rollout.judge.serve=/m", "placement.mode=colocated", "placement.num_gpus=1"],
     "rollout.judge.serve: with a shared GPU placement the run does not place a judge engine"),
])
def test_config_mistakes_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_checked(None, overrides)


def test_the_driver_provisions_the_served_judge():
    import driver

    cfg = load_config(None, ["rollout.reward=judge", "rollout.judge.serve=smollm2-135m-instruct"])
    assert ("rollout.judge.serve", "smollm2-135m-instruct") in driver.model_paths(cfg)
    assert cfg.rollout.judge.base_url is None and cfg.rollout.judge.num_engines == 1


def test_a_served_judge_that_was_not_started_fails_the_call_and_sends_nothing():
    """A worker given ``rollout.judge.serve`` without the endpoint the run starts (a notebook that skipped it) fails
    the episode's grading as judge_failed, and never falls back on the openai SDK's default endpoint."""
    judge = Judge(JudgeConfig(serve="/some/judge", timeout_s=5.0))
    with pytest.raises(JudgeError, match=r"^the judge rollout.judge.serve names \(/some/judge\) was not started"):
        judge.ask(QUESTION)
    assert judge._client is None  # no client was made, so no request went anywhere
