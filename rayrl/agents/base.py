"""The agent contract: what an agent gets for one Task, and what it hands back for the reward.

Three forms plug in (docs/agents.md): a plain function ``agent(task, endpoint) -> answer`` that gets an
:class:`Endpoint` (rayrl/agents/function_agent.py), a program that reads its endpoint from environment
variables (rayrl/agents/command_agent.py), and a :class:`BaseHarness` subclass that gets the whole
:class:`EpisodeContext` (sandbox, sampling settings, deadline) for harnesses that need more. All of them
end in an :class:`AgentResult` that the reward function scores. Agents never see token ids: the
gateway records those.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from rayrl.sandboxes.base import Sandbox
from rayrl.types import Task


def gateway_root(base_url: str) -> str:
    """The gateway's root URL from its OpenAI base URL (…/v1): what Anthropic clients want."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class Endpoint:
    """Where an agent sends its LLM calls for one episode: an OpenAI-compatible API (Chat Completions and
    Responses under ``base_url``, Anthropic Messages under :attr:`anthropic_base_url`) that records every
    call for training. ``api_key`` is the episode's own token; ``model`` is the name to send. The rest are
    the run's settings (``rollout.*``), for an agent that wants to honour them."""

    base_url: str  # the gateway's OpenAI base URL (…/v1)
    api_key: str  # the episode's bearer token: the gateway tells episodes apart by it
    model: str  # the model name to send
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256  # per LLM call
    max_turns: int = 8  # LLM calls the agent should stop after

    @property
    def anthropic_base_url(self) -> str:
        """The gateway's root, for Anthropic SDKs (they append /v1/messages)."""
        return gateway_root(self.base_url)


@dataclass
class EpisodeContext:
    """Everything an agent needs for one episode."""

    base_url: str  # the gateway's OpenAI base URL (…/v1)
    api_key: str  # the session's bearer token
    model: str  # the model name to send
    sandbox: Sandbox | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    max_turns: int = 8
    deadline: float = float("inf")  # time.monotonic() by which the agent must stop
    system_prompt: str | None = None
    session_id: str = ""  # the gateway session (for logs and correlation)
    episode_index: int = 0  # this episode's index within its GRPO group

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def endpoint(self) -> Endpoint:
        """The part a plain function agent gets."""
        return Endpoint(self.base_url, self.api_key, self.model, self.temperature, self.top_p, self.max_tokens,
                        self.max_turns)


@dataclass
class AgentResult:
    """What the agent ended with; the reward function scores it (``reward(task, result) -> float``).

    A function agent's returned string becomes ``final_answer``. ``status`` is "completed" for an agent
    that finished (right or wrong), "max_turns" for one that ran out of turns, and "error" for one that
    raised or reported a failure, with ``error`` saying what; the reward function sees all three.
    ``tool_calls`` is set by the episode runner, before the reward function sees the result, to the tool
    calls the model made as the gateway recorded them (so a function or program agent needs to count
    nothing); ``turns`` likewise when the agent left it 0.
    """

    final_answer: str | None = None
    status: str = "completed"  # completed | max_turns | error
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    error: str | None = None
    failure: str | None = None  # with status "error": its kind (rayrl/rl/failures.py) when the harness knows it
    transcript: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # harness-specific extras (e.g. an AgentCore result)


class BaseHarness(ABC):
    """Starts one agent for one Task, waits for it, and reports its result.

    rayrl constructs a subclass named in ``rollout.agent`` with no arguments (a subclass of
    ``PythonToolAgent`` also gets ``tools``, ``few_shot_examples`` and ``tool_delay_s`` from ``rollout.*``),
    once per rollout worker, and calls :meth:`run` from several threads at once: keep per-episode state
    in ``run``'s locals.
    """

    name: str = "base"
    needs_sandbox: bool = True  # False: no sandbox is leased (the agent runs elsewhere, or its tools are its own)

    @abstractmethod
    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        """Run the agent to completion (or ``ctx.deadline``). Raising counts against the task, as a result
        with status "error" does (``agent_crashed``); raise :class:`rayrl.rl.failures.InfrastructureError`
        when the system failed instead (docs/agents.md)."""
