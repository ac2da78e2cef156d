"""Agents hosted on Amazon Bedrock AgentCore Runtime (agentcore-rl-toolkit parity; docs/agentcore.md).

Agent side (inside the agent's container): :func:`rollout_executor` / :class:`RolloutExecutor`.
Trainer side: :class:`RolloutLauncher` (boto3 ``invoke_agent_runtime`` within the run's limits, results
from S3) and the ``agentcore`` harness. Local mode: :class:`LocalAgentCore` runs the agent app behind a
FAKE runtime (emulator.py) with a moto S3 server. Only the agent side needs ``bedrock-agentcore``; both
need boto3 (``pip install 'rayrl[aws]'``). Names are imported lazily so neither side pays for the other.
"""

from __future__ import annotations

from typing import Any

from rayrl.agents.agentcore.protocol import (
    ROLLOUT_CONFIG_KEY,
    AgentRolloutConfig,
    AgentRolloutConfigError,
    result_key,
)

_LAZY = {
    "RolloutExecutor": "rayrl.agents.agentcore.executor",
    "RolloutContext": "rayrl.agents.agentcore.executor",
    "rollout_executor": "rayrl.agents.agentcore.executor",
    "RolloutLauncher": "rayrl.agents.agentcore.launcher",
    "SessionOutcome": "rayrl.agents.agentcore.launcher",
    "BatchResult": "rayrl.agents.agentcore.launcher",
    "BatchItem": "rayrl.agents.agentcore.launcher",
    "AgentCoreHarness": "rayrl.agents.agentcore.harness",
    "RateLimiter": "rayrl.agents.agentcore.rate_limit",
    "LocalAgentCore": "rayrl.agents.agentcore.local",
    "FakeAgentCoreRuntime": "rayrl.agents.agentcore.emulator",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ROLLOUT_CONFIG_KEY", "AgentRolloutConfig", "AgentRolloutConfigError", "result_key"] + list(_LAZY)
