"""Each silent failure planted in real episodes, and its guard fires from what the gateway recorded.

A real EpisodeRunner drives the real python tool-use agent (openai SDK) against a real gateway in front
of a scripted engine (tests/gateway/scripted_engine.py), with a real local sandbox, as in
test_infra_failures.py; the episodes it returns carry the gateway's facts (``info["gateway"]``), and
rayrl/rl/guards.py reads nothing else. Planted: a model whose tool calls never parse, an agent that
answers without its tools and still scores, answers cut at max_tokens, a template that drops earlier
reasoning (Qwen3's, re-rendered), an engine that fails, a judge that raises. The control: a healthy
step, where the model calls its tool and rewards vary, fires nothing.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from rayrl.agents.base import AgentResult
from rayrl.agents.episode import EpisodeRunner, gateway_facts
from rayrl.agents.python_agent import PythonToolAgent
from rayrl.config import GatewayConfig, GuardsConfig, RolloutConfig
from rayrl.rewards.math import numeric_answer_reward
from rayrl.rl.failures import JUDGE_FAILED, JudgeError
from rayrl.rl.guards import StepView, check_guards
from rayrl.types import Episode, Task
from tests.gateway.episode_kit import InProcessSessions, LocalSandboxes
from tests.gateway.family_templates import qwen3_tokenizer
from tests.gateway.scripted_engine import ENGINE_FAILURE, last_role
from tests.gateway.test_families import _episode, _reasoning_script

TASK = Task("What is 3 + 4?", {"question": "What is 3 + 4?", "answer": 7}, task_id="t-7")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4"}}</tool_call>'


def run_step(stack: Any, n: int, reward: Callable = numeric_answer_reward, max_tokens: int = 64,
             max_turns: int = 3) -> list[Episode]:
    """``n`` episodes of TASK in groups of two, as a step takes them."""
    cfg = RolloutConfig(tools=["calculator"], few_shot_examples=0, max_turns=max_turns, episode_timeout_s=60,
                        temperature=0.0, max_tokens=max_tokens)
    runner = EpisodeRunner(PythonToolAgent(tools=["calculator"], few_shot_examples=0, client_retries=0), reward,
                           InProcessSessions(stack), LocalSandboxes(), cfg, "tiny")
    return [runner.run(TASK, f"g{i // 2}", i % 2) for i in range(n)]


def fired(episodes: list[Episode], max_turns: int = 3) -> dict[str, Any]:
    report = check_guards(StepView(episodes, max_turns), GuardsConfig(), step=1, episodes_file="e.jsonl")
    return {c.guard: c for c in report.crossings}


def test_a_healthy_tool_using_step_fires_nothing(scripted):
    answers = itertools.cycle(["The answer is 7.", "The answer is 8."])

    def script(prompt: str) -> str:  # call the tool, then answer: right and wrong in turn
        return next(answers) if last_role(prompt) == "tool" else CALL

    episodes = run_step(scripted(script), 8)
    assert all(e.info["gateway"]["tool_calls"] == 1 for e in episodes)
    assert [e.reward for e in episodes] == [1.0, 0.0] * 4
    assert fired(episodes) == {}


def test_a_model_whose_tool_calls_never_parse(scripted):
    episodes = run_step(scripted(lambda p: '<tool_call>{"name": "calculator", "arguments": </tool_call>'), 4)
    assert [e.info["gateway"]["tool_parse_errors"] for e in episodes] == [1] * 4
    crossing = fired(episodes)["tool_parse_errors"]
    assert crossing.value == 1.0 and crossing.session_id == episodes[0].session_id


def test_an_agent_that_answers_without_its_tools_and_still_scores(scripted):
    episodes = run_step(scripted(lambda p: "The answer is 7."), 8)
    assert all(e.reward == 1.0 and e.info["gateway"]["tool_turns"] == 1 for e in episodes)
    got = fired(episodes)
    assert {"unused_tools", "tool_call_rate", "zero_variance_groups"} <= set(got)
    assert got["unused_tools"].value == 1.0


def test_answers_cut_at_max_tokens(scripted):
    long = "Let me think about this very carefully, one small step after another, before I answer: 7."
    episodes = run_step(scripted(lambda p: long), 4, max_tokens=8)
    assert all(e.info["gateway"]["length_turns"] == 1 for e in episodes)
    report = check_guards(StepView(episodes, 3), GuardsConfig(), step=1)
    assert report.metrics["guards/truncated_rate"] == 1.0
    assert report.metrics["guards/truncated_reward_share"] == 0.0
    assert "truncation" in fired(episodes)


def test_an_engine_that_fails_and_a_judge_that_raises(scripted):
    infra = run_step(scripted(lambda p: ENGINE_FAILURE), 4)
    assert "infra_failures" in fired(infra)

    def judge(task: Task, result: AgentResult) -> float:
        raise RuntimeError("judge endpoint answered 429")

    judged = run_step(scripted(lambda p: "The answer is 7."), 4, reward=judge)
    assert fired(judged)["reward_failures"].value == 1.0  # reward_failed: scored 0

    def silent_judge(task: Task, result: AgentResult) -> float:
        raise JudgeError("the judge gave no answer after 3 attempt(s): 503")

    unjudged = run_step(scripted(lambda p: "The answer is 7."), 4, reward=silent_judge)
    assert {e.failure for e in unjudged} == {JUDGE_FAILED}
    assert {"reward_failures", "infra_failures"} <= set(fired(unjudged))  # judge_failed: left out, infrastructure


def test_a_template_that_drops_reasoning_drifts(scripted):
    """Qwen3's template drops earlier turns' reasoning; re-rendering each prompt (no cumulative token mode)
    makes the next turn disagree with the tokens sampled: drift, which the guard reports."""
    tok = qwen3_tokenizer()
    stack = scripted(_reasoning_script(False), cfg=GatewayConfig(cumulative_token_mode=False), tokenizer=tok,
                     model_name="Qwen/Qwen3-8B")
    stack.engine.eos = tok.eos_token_id
    episodes = []
    for i in range(4):
        stats, _ = _episode(stack)
        e = Episode(f"s{i}", "t", f"g{i}", reward=1.0)
        e.info = {"gateway": gateway_facts(stats)}
        episodes.append(e)
    assert all(e.info["gateway"]["drift"] >= 1 for e in episodes)
    assert fired(episodes)["drift"].value == 1.0
