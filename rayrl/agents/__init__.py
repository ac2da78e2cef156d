"""Agent harnesses: how an unmodified agent is run for one task against the gateway."""

from __future__ import annotations

from rayrl.agents.base import AgentResult, BaseHarness, EpisodeContext


def make_harness(name: str, **kwargs) -> BaseHarness:
    """A harness by registered name, or ``package.module:Class`` for your own."""
    if name == "python_tool_agent":
        from rayrl.agents.python_agent import PythonToolAgent

        return PythonToolAgent(**kwargs)
    if name == "claude_code":
        from rayrl.agents.claude_code import ClaudeCodeHarness

        return ClaudeCodeHarness(**kwargs)
    if name == "codex":
        from rayrl.agents.codex import CodexHarness

        return CodexHarness(**kwargs)
    if name == "agentcore":  # needs launcher=, cfg= (AgentCoreConfig) and exp_id=
        from rayrl.agents.agentcore.harness import AgentCoreHarness

        return AgentCoreHarness(**kwargs)
    if ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        return cls(**kwargs)
    raise ValueError(f"rollout.agent: unknown harness {name!r} (python_tool_agent, claude_code, codex, agentcore, or module:Class)")


__all__ = ["AgentResult", "BaseHarness", "EpisodeContext", "make_harness"]
