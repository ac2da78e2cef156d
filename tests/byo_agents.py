"""Agents and rewards that fail on purpose, named in configs as a user would (``tests.byo_agents:name``).

Run as a program (``python tests/byo_agents.py CODE``) it is an agent program that makes one LLM call
and then exits with CODE, saying why on stderr; as a program it needs nothing but the openai SDK.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from openai import AsyncOpenAI, OpenAI


async def crashes_after_one_call(task: Any, endpoint: Any) -> str:
    """Makes one LLM call, then trips over a key the task does not have (a bug in the agent)."""
    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client:
        await client.chat.completions.create(model=endpoint.model, max_tokens=8,
                                             messages=[{"role": "user", "content": task.prompt}])
    return task.metadata["unit_label"]


def plain_def(task: Any, endpoint: Any) -> str:
    """A plain (not async) function agent with the sync openai client: the example's exchange, by hand."""
    from examples.unit_convert.agent import TOOLS

    client = OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    for _ in range(endpoint.max_turns):
        message = client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=64,
                                                 tools=TOOLS).choices[0].message
        if not message.tool_calls:
            return message.content or ""
        call = message.tool_calls[0]
        messages += [{"role": "assistant", "content": "", "tool_calls": [
                         {"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "91.44"}]
    return ""


async def sleeps(task: Any, endpoint: Any) -> str:
    """Never answers: cancelled at the episode deadline."""
    await asyncio.sleep(3600)
    return ""


async def fails_by_task(task: Any, endpoint: Any) -> str:
    """One LLM call, then: task "...-bug" trips over a missing key (the agent's own failure, every time);
    task "...-infra" finds its tool service down (an infrastructure failure, every time); others answer."""
    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client:
        reply = await client.chat.completions.create(model=endpoint.model, max_tokens=endpoint.max_tokens,
                                                     messages=[{"role": "user", "content": task.prompt}])
    if task.task_id.endswith("-bug"):
        return task.metadata["unit_label"]
    if task.task_id.endswith("-infra"):
        from rayrl.rl.failures import InfrastructureError

        raise InfrastructureError("the tool service answered 503")
    return reply.choices[0].message.content or ""


def reward_with_a_bug(task: Any, result: Any) -> float:
    return 1 / 0


def reward_grader_down(task: Any, result: Any) -> float:
    from rayrl.rl.failures import InfrastructureError

    raise InfrastructureError("the grader service did not answer")


def reward_takes_one_argument(result: Any) -> float:
    """A wrong signature: rewards are called as reward(task, result)."""
    return 0.0


def agent_takes_three_arguments(task: Any, endpoint: Any, extra: Any) -> str:
    """A wrong signature: agents are called as agent(task, endpoint)."""
    return ""


TOOL_LIMIT = 3  # not a function: rollout.agent cannot name it


class NeedsArguments:
    """Not a BaseHarness: a class that is neither a harness nor a function."""


if __name__ == "__main__":
    import json
    import os

    row = json.load(sys.stdin)
    OpenAI(max_retries=0).chat.completions.create(model=os.environ["OPENAI_MODEL"], max_tokens=8,
                                                  messages=[{"role": "user", "content": row["prompt"]}])
    code = int(sys.argv[1])
    print("service down" if code == 75 else "agent bug", file=sys.stderr)
    sys.exit(code)
