"""Infrastructure failures do not score as reward 0; an agent's own mistakes and errors do.

A real EpisodeRunner drives the real python tool-use agent (openai SDK) against a real gateway in
front of a scripted engine (a real HTTP server speaking SGLang's /generate, tests/gateway/
scripted_engine.py), with a real local sandbox. What fails is chosen per test: the engine answers 500
to one call (the agent retries, as CLIs do, and then answers), the sandbox vanishes, the reward
function raises (the task's own error: scored 0), or the model simply answers wrong.
"""

from __future__ import annotations

import shutil
from typing import Any

from rayrl.agents.base import AgentResult, EpisodeContext
from rayrl.agents.episode import EpisodeRunner
from rayrl.agents.python_agent import PythonToolAgent
from rayrl.config import RolloutConfig
from rayrl.rewards.math import numeric_answer_reward
from rayrl.rl.failures import ENGINE_ERROR, REWARD_FAILED, SANDBOX_FAILED, is_infra, is_scored
from rayrl.types import Task
from tests.gateway.episode_kit import InProcessSessions, LocalSandboxes
from tests.gateway.scripted_engine import ENGINE_FAILURE

TASK = Task("What is 3 + 4?", {"question": "What is 3 + 4?", "answer": 7}, task_id="t-7")


def _runner(stack: Any, agent: Any = None, reward: Any = numeric_answer_reward) -> EpisodeRunner:
    cfg = RolloutConfig(tools=["calculator"], few_shot_examples=0, max_turns=3, episode_timeout_s=60,
                        temperature=0.0, max_tokens=64)
    return EpisodeRunner(agent or PythonToolAgent(tools=["calculator"], few_shot_examples=0), reward,
                         InProcessSessions(stack), LocalSandboxes(), cfg, "tiny")


def test_a_wrong_answer_is_scored_not_failed(scripted):
    stack = scripted(lambda prompt: "The answer is 8.")
    episode = _runner(stack).run(TASK, "g1", 0)
    assert episode.ok and episode.failure is None and episode.reward == 0.0  # GRPO learns from this one
    assert episode.samples  # and it trains


def test_a_bad_tool_call_then_the_right_answer_is_scored(scripted):
    replies = iter(['<tool_call>{"name": "calculator", "arguments": {"expression": "3 +"}}</tool_call>',
                    "The answer is 7."])
    stack = scripted(lambda prompt: next(replies))
    episode = _runner(stack).run(TASK, "g1", 0)
    assert episode.ok and episode.reward == 1.0 and episode.info["tool_errors"] == 1


def test_an_engine_failure_the_agent_survived_is_infrastructure(scripted):
    calls = {"n": 0}

    def script(prompt: str) -> str:
        calls["n"] += 1
        return ENGINE_FAILURE if calls["n"] == 1 else "The answer is 8."  # fails once, then a wrong answer

    stack = scripted(script)
    agent = PythonToolAgent(tools=["calculator"], client_retries=1)  # retries a failed call, as CLIs do
    episode = _runner(stack, agent=agent).run(TASK, "g", 0)
    assert calls["n"] == 2  # the agent retried and finished: it did not crash
    assert not episode.ok and episode.failure == ENGINE_ERROR and is_infra(episode)
    assert "failed in the engine or gateway" in episode.error  # not a reward of 0 that GRPO would learn from
    assert episode.samples  # the recorded turn is kept for inspection, never trained (rayrl/rl/batch.py)


def test_a_sandbox_that_dies_is_infrastructure(scripted):
    class KillsItsSandbox(PythonToolAgent):
        def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
            shutil.rmtree(ctx.sandbox.paths.root)  # as when a node's disk is cleaned under a running episode
            return super().run(task, ctx)

    stack = scripted(lambda prompt: '<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>')
    episode = _runner(stack, agent=KillsItsSandbox(tools=["calculator"])).run(TASK, "g", 0)
    assert episode.failure == SANDBOX_FAILED and is_infra(episode) and episode.reward == 0.0


def test_a_reward_function_that_raises_counts_against_the_task(scripted):
    def broken_reward(task: Task, result: AgentResult) -> float:
        raise KeyError("answer")

    stack = scripted(lambda prompt: "The answer is 7.")
    episode = _runner(stack, reward=broken_reward).run(TASK, "g", 0)
    assert episode.failure == REWARD_FAILED and not is_infra(episode) and "KeyError" in episode.error
    assert is_scored(episode) and episode.reward == 0.0 and episode.samples  # trained with reward 0, not rerun
