"""The single-turn chat agent: the task's prompt as one user message, the reply as the final answer.

What question-answer tasks need (reasoning-gym's, GSM8K without tools): no tools, no sandbox, one Chat
Completions call through the openai SDK against the gateway, with ``rollout.system_prompt`` (if set)
as the system message and the run's sampling settings (``rollout.agent: chat``).

``rollout.example_turns`` go between the system message and the task as earlier user/assistant turns: a
small model copies the format of a reply it sees itself give (SmolLM2-135M uses reasoning-gym's
``<answer>`` tags when shown three such turns, rarely when the same example is in the system prompt;
docs/results/reasoning_gym.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import openai

from rayrl.agents.base import AgentResult, BaseHarness, EpisodeContext
from rayrl.types import Task


class ChatAgent(BaseHarness):
    """One Chat Completions call per episode."""

    name = "chat"
    needs_sandbox = False

    def __init__(self, system_prompt: str | None = None, example_turns: Sequence[tuple[str, str]] = ()) -> None:
        self.system_prompt = system_prompt
        self.example_turns = [(user, assistant) for user, assistant in example_turns]

    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        system = ctx.system_prompt or self.system_prompt
        messages = [{"role": "system", "content": system}] if system else []
        for user, assistant in self.example_turns:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        messages.append({"role": "user", "content": task.prompt})
        with openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                           timeout=max(1.0, ctx.time_left())) as client:
            resp = client.chat.completions.create(model=ctx.model, messages=messages, temperature=ctx.temperature,
                                                  top_p=ctx.top_p, max_tokens=ctx.max_tokens)
        answer = resp.choices[0].message.content or ""
        status = "completed"
        messages.append({"role": "assistant", "content": answer})
        return AgentResult(final_answer=answer, status=status, turns=1, transcript=messages)
