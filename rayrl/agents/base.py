"""The harness layer: how one agent is started for one Task against the gateway.

A harness gets an :class:`EpisodeContext` (gateway URL, per-session token, sandbox, sampling settings,
deadline) and returns an :class:`AgentResult` for the reward function. Harnesses never see token ids:
the gateway records those.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from rayrl.sandboxes.base import Sandbox
from rayrl.types import Task


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


@dataclass
class AgentResult:
    """What the agent ended with; the reward function scores it."""

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
    """Starts one agent for one Task, waits for it, and reports its result."""

    name: str = "base"
    needs_sandbox: bool = True  # False: the agent runs elsewhere (AgentCore), so no sandbox is leased

    @abstractmethod
    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        """Run the agent to completion (or ``ctx.deadline``); raise only on harness bugs."""
