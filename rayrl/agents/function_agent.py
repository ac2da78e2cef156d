"""A plain function as the agent: ``async def agent(task, endpoint) -> str`` (a plain ``def`` works too).

The plain case needs no rayrl class. The function gets the :class:`~rayrl.types.Task` (``prompt``,
``metadata``, ``task_id``) and an :class:`~rayrl.agents.base.Endpoint` (``base_url``, ``api_key``,
``model``, plus the run's sampling settings), makes its LLM calls there with any client (the openai SDK,
an Anthropic SDK at ``endpoint.anthropic_base_url``, a framework built on either), and returns the final
answer as a string (or an :class:`~rayrl.agents.base.AgentResult` to report more). Its tools are its
own business: they run in the agent's process, so no sandbox is leased for it.

An async function runs on a fresh event loop in the episode's thread and is cancelled at the episode
deadline (``rollout.episode_timeout_s``); a plain function is abandoned there, and the gateway refuses
its further calls. What it raises is the agent's own failure unless it is an
:class:`~rayrl.rl.failures.InfrastructureError` (docs/agents.md).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Awaitable, Callable

from rayrl.agents.base import AgentResult, BaseHarness, Endpoint, EpisodeContext
from rayrl.rl.failures import TIMED_OUT
from rayrl.types import Task

CANCEL_MARGIN_S = 1.0  # an async agent is cancelled this long (at most 10% of its time) before the deadline


class FunctionAgent(BaseHarness):
    """Runs ``fn(task, endpoint)`` for each episode (``rollout.agent: package.module:function``)."""

    name = "function"
    needs_sandbox = False

    def __init__(self, fn: Callable[[Task, Endpoint], Any], ref: str = "") -> None:
        self.fn = fn
        self.ref = ref or getattr(fn, "__qualname__", "the agent")
        # a coroutine function, or an object whose __call__ is one
        self.is_async = inspect.iscoroutinefunction(fn) or (callable(fn) and inspect.iscoroutinefunction(fn.__call__))

    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        endpoint = ctx.endpoint()
        if not self.is_async:
            answer = self.fn(task, endpoint)
            if not inspect.isawaitable(answer):
                return as_result(answer, self.ref)
            return self._wait(answer, ctx)  # a plain function that hands back a coroutine
        return self._wait(self.fn(task, endpoint), ctx)

    def _wait(self, awaitable: Awaitable[Any], ctx: EpisodeContext) -> AgentResult:
        """Run ``awaitable`` on a fresh event loop, cancelled a little before the runner stops waiting (so
        no thread is left behind)."""
        left = ctx.time_left()
        timeout = None if left == float("inf") else max(left - min(CANCEL_MARGIN_S, 0.1 * left), 0.0)

        async def bounded() -> Any:
            return await asyncio.wait_for(awaitable, timeout)

        try:
            answer = asyncio.run(bounded())
        except asyncio.TimeoutError:
            return AgentResult(status="error", error=f"{self.ref} was cancelled at the episode deadline",
                               failure=TIMED_OUT)
        return as_result(answer, self.ref)


def as_result(answer: Any, ref: str) -> AgentResult:
    """The AgentResult of what an agent function returned: a string is the final answer; None is no answer."""
    if isinstance(answer, AgentResult):
        return answer
    if answer is None or isinstance(answer, str):
        return AgentResult(final_answer=answer, status="completed")
    raise TypeError(f"{ref} returned a {type(answer).__name__}; return the final answer as a str "
                    "(or a rayrl.agents.AgentResult)")
