"""Pieces the pipeline tests plug in through config (``module:name``), as a user would.

``SlowToolAgent`` makes two LLM calls with real sandbox work between them (``sleep`` in the episode's
sandbox), like an agent whose tool takes time; ``index_reward`` gives every group reward variance so
each step trains (the tiny random model's text is noise).
"""

from __future__ import annotations

import openai

from rayrl.agents.base import AgentResult, BaseHarness, EpisodeContext
from rayrl.types import Task

TOOL_SECONDS = 1.5


def index_reward(task: Task, result: AgentResult) -> float:
    """1.0 for odd episode indices: every group of 2+ episodes has variance."""
    return float(result.info.get("episode_index", 0) % 2)


class SlowToolAgent(BaseHarness):
    """LLM call, ``TOOL_SECONDS`` of sandbox work, LLM call."""

    name = "slow_tool_agent"

    def __init__(self, tools: list[str] | None = None, few_shot_examples: int = 0, **_: object) -> None:
        pass

    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=120)
        messages = [{"role": "user", "content": task.prompt}]
        answer = ""
        for turn in range(2):
            reply = client.chat.completions.create(
                model=ctx.model, messages=messages, max_tokens=ctx.max_tokens, temperature=ctx.temperature
            )
            answer = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": answer})
            if turn == 0:
                assert ctx.sandbox is not None
                result = ctx.sandbox.exec(["sleep", str(TOOL_SECONDS)], timeout=60)
                messages.append({"role": "user", "content": f"the tool finished with exit code {result.exit_code}"})
        return AgentResult(final_answer=answer, turns=2, info={"episode_index": ctx.episode_index})
