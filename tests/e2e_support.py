"""Pieces the end-to-end test plugs in through config (``module:name``), as a user would.

The tiny random model never writes a valid tool call, so the reward here scores the text itself to
give GRPO some variance; the harness misbehaves on purpose for two episodes of each step.
"""

from __future__ import annotations

import shutil

import openai

from rayrl.agents.base import AgentResult, EpisodeContext
from rayrl.agents.python_agent import PythonToolAgent
from rayrl.types import Task


def parity_reward(task: Task, result: AgentResult) -> float:
    """1.0 when the final answer has an even number of characters: arbitrary, but it varies."""
    return 1.0 if len(result.final_answer or "") % 2 == 0 else 0.0


def index_parity_reward(task: Task, result: AgentResult) -> float:
    """1.0 for even episode indexes (``IndexedAgent`` records them): every group has both rewards, so
    every step trains."""
    return 1.0 if result.info.get("episode_index", 0) % 2 == 0 else 0.0


class IndexedAgent(PythonToolAgent):
    """The python agent, recording the episode's index in the group for ``index_parity_reward``."""

    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        result = super().run(task, ctx)
        result.info["episode_index"] = ctx.episode_index
        return result


class FlakyAgent(PythonToolAgent):
    """The python agent, except, for task "...first": episode 0 crashes, episode 1 loops forever, and
    episode 2's sandbox dies under it (its directory vanishes, as when a node's disk is cleaned)."""

    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        index = ctx.episode_index
        if task.task_id.endswith("first") and index == 0:
            raise RuntimeError("agent bug on purpose")
        if task.task_id.endswith("first") and index == 1:
            client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
            while True:  # stopped by the episode deadline, then by the gateway's 409
                client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "again"}],
                                               max_tokens=4)
        if task.task_id.endswith("first") and index == 2:
            shutil.rmtree(ctx.sandbox.paths.root)
        return super().run(task, ctx)


def task_mixed_reward(task: Task, result: AgentResult) -> float:
    """Every episode of a task whose id ends in 0, 1, 2 or 3 gets 1.0 (a group with nothing to learn, what
    dynamic sampling drops); the others get ``index_parity_reward`` (both rewards in every group)."""
    if task.task_id[-1] in "0123":
        return 1.0
    return index_parity_reward(task, result)
