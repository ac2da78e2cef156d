"""The python tool-use agent: a plain loop over the `openai` SDK, like the agents users already have.

It talks to the gateway exactly as it would talk to OpenAI: chat completions with ``tools``; each tool
call runs in the episode's sandbox and its output goes back as a ``tool`` message. The final text answer
is what the reward function scores.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import openai

from rayrl.agents.base import AgentResult, BaseHarness, EpisodeContext
from rayrl.agents.toolbox import make_tools
from rayrl.agents.tools import Tool, parse_arguments
from rayrl.types import Task

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. You answer questions by calling the tools you are given."


class PythonToolAgent(BaseHarness):
    """A multi-turn tool-use loop over the OpenAI Chat Completions API."""

    name = "python_tool_agent"

    def __init__(
        self,
        tools: list[str] | None = None,
        system_prompt: str | None = None,
        few_shot_examples: int = 0,
        tool_delay_s: Sequence[float] = (),
        client_retries: int = 0,
    ) -> None:
        """``client_retries``: how often the openai client retries a failed call (0: an engine failure ends
        the episode at once; agents in the wild, Claude Code and Codex among them, retry)."""
        self.tool_names = tools or ["calculator"]
        self.client_retries = client_retries
        self.tool_delay_s = tuple(tool_delay_s)
        self.system_prompt = system_prompt or DEFAULT_SYSTEM_PROMPT
        self.few_shot_examples = few_shot_examples

    def demonstrations(self, tools: list[Tool]) -> list[dict[str, Any]]:
        """Worked examples as earlier chat turns: small models follow a shown exchange far better
        than a described format (for SmolLM2-135M-Instruct: docs/results/design_figures.md). A demo
        whose steps use a tool the agent was not given is skipped."""
        names = {t.name for t in tools}
        demos = [d for t in tools for d in t.demos if all(step[0] in names for step in d[1])]
        messages: list[dict[str, Any]] = []
        n = 0
        for question, steps, answer in demos[: self.few_shot_examples]:
            messages.append({"role": "user", "content": question})
            for name, args, output in steps:
                call_id = f"call_example_{n}"
                n += 1
                messages += [
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": call_id, "type": "function",
                         "function": {"name": name, "arguments": json.dumps(args)}}]},
                    {"role": "tool", "tool_call_id": call_id, "content": output},
                ]
            messages.append({"role": "assistant", "content": answer})
        return messages

    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        payload = task.payload()
        tools: list[Tool] = make_tools(self.tool_names, self.tool_delay_s)
        for tool in tools:
            tool.setup(ctx.sandbox)
        by_name = {t.name: t for t in tools}
        question = payload.get("question") or payload.get("prompt") or task.prompt
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": ctx.system_prompt or self.system_prompt},
            *self.demonstrations(tools),
            {"role": "user", "content": str(question)},
        ]
        result = AgentResult(transcript=messages)
        client = openai.OpenAI(
            base_url=ctx.base_url, api_key=ctx.api_key, max_retries=self.client_retries,
            timeout=max(1.0, ctx.time_left())
        )
        try:
            for _ in range(ctx.max_turns):
                if ctx.time_left() <= 0:
                    result.status, result.error = "error", "deadline reached"
                    return result
                resp = client.chat.completions.create(
                    model=ctx.model,
                    messages=messages,
                    tools=[t.schema() for t in tools],
                    temperature=ctx.temperature,
                    top_p=ctx.top_p,
                    max_tokens=ctx.max_tokens,
                )
                result.turns += 1
                msg = resp.choices[0].message
                assistant: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
                if msg.tool_calls:
                    assistant["tool_calls"] = [
                        {"id": c.id, "type": "function",
                         "function": {"name": c.function.name, "arguments": c.function.arguments}}
                        for c in msg.tool_calls
                    ]
                messages.append(assistant)
                if not msg.tool_calls:
                    result.final_answer = msg.content or ""
                    result.status = "completed"
                    return result
                for call in msg.tool_calls:
                    result.tool_calls += 1
                    output, ok = self._call_tool(by_name, call.function.name, call.function.arguments, ctx)
                    result.tool_errors += 0 if ok else 1
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
            result.status = "max_turns"
            return result
        finally:
            client.close()

    @staticmethod
    def _call_tool(by_name: dict[str, Tool], name: str, raw_args: str, ctx: EpisodeContext) -> tuple[str, bool]:
        tool = by_name.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}; available: {', '.join(by_name)}", False
        try:
            args = parse_arguments(raw_args)
        except ValueError as err:
            return f"error: {err}", False
        return tool.call(ctx.sandbox, args)
