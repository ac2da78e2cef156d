"""Agents: how an unmodified agent is run for one task against the gateway (docs/agents.md).

``rollout.agent`` names one of:

* a built-in harness: ``python_tool_agent``, ``chat`` (one reply, no tools), ``claude_code``, ``codex``, ``agentcore``;
* ``command``: any program that reads its endpoint from the environment (``rollout.agent_command``,
  rayrl/agents/command_agent.py);
* ``package.module:function``: a plain function ``agent(task, endpoint) -> str``, async or not
  (rayrl/agents/function_agent.py);
* ``package.module:Class``: a :class:`BaseHarness` subclass, for harnesses that need the sandbox or the
  whole :class:`EpisodeContext`. It is constructed with no arguments (a ``PythonToolAgent`` subclass also
  gets ``rollout.tools``, ``few_shot_examples`` and ``tool_delay_s``).

:func:`agent_factory` checks all of this when the config is loaded (rayrl/preflight.py) and gives each
rollout worker what builds its harness, so a typo or a wrong signature is a config error naming
``rollout.agent``, never a TypeError inside a worker.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Any, Callable

from rayrl.agents.base import AgentResult, BaseHarness, Endpoint, EpisodeContext
from rayrl.config import ConfigError, RolloutConfig
from rayrl.extensions import check_call, did_you_mean, load_reference
from rayrl.rl.failures import InfrastructureError

BUILT_IN = ("python_tool_agent", "chat", "claude_code", "codex", "agentcore", "command")
FIELD = "rollout.agent"


def python_agent_options(rollout: RolloutConfig) -> dict[str, Any]:
    """The python tool-use agent's constructor arguments from ``rollout.*``."""
    options: dict[str, Any] = {"tools": list(rollout.tools), "few_shot_examples": rollout.few_shot_examples}
    if rollout.tool_delay_s:
        options["tool_delay_s"] = list(rollout.tool_delay_s)
    return options


def _check_tools(rollout: RolloutConfig) -> None:
    from rayrl.agents.toolbox import TOOLS

    unknown = [t for t in rollout.tools if t not in TOOLS]
    if unknown:
        hint = did_you_mean(unknown[0], list(TOOLS))
        raise ConfigError(f"rollout.tools: unknown tool {unknown[0]!r}{hint}; available: {', '.join(sorted(TOOLS))}")


def _class_factory(cls: type, rollout: RolloutConfig, ref: str) -> Callable[[], BaseHarness]:
    from rayrl.agents.python_agent import PythonToolAgent

    if not issubclass(cls, BaseHarness):
        raise ConfigError(f"{FIELD}: {ref} is a class but not a rayrl.agents.BaseHarness subclass; write a "
                          "function agent(task, endpoint) -> str instead, or subclass BaseHarness (docs/agents.md)")
    if inspect.isabstract(cls):
        raise ConfigError(f"{FIELD}: {ref} does not implement run(task, ctx)")
    check_call(cls.run, FIELD, f"{ref}.run", ("self", "task", "ctx"), "harness.run(task, ctx) -> AgentResult")
    kwargs: dict[str, Any] = {}
    if issubclass(cls, PythonToolAgent):
        _check_tools(rollout)
        kwargs = python_agent_options(rollout)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as err:
        given = ", ".join(kwargs) or "none"
        raise ConfigError(f"{FIELD}: {ref}() cannot be constructed with the arguments rayrl passes ({given}): "
                          f"{err}; give its parameters defaults") from None
    except ValueError:  # no signature to check
        pass
    return lambda: cls(**kwargs)


def _command_factory(rollout: RolloutConfig) -> Callable[[], BaseHarness]:
    from rayrl.agents.command_agent import CommandAgent, command_argv

    argv = command_argv(list(rollout.agent_command))
    if shutil.which(argv[0]) is None:
        raise ConfigError(f"rollout.agent_command: {argv[0]!r} is not an executable on PATH or a file")
    scripts = [a for a in argv[1:2] if a.endswith(".py")]
    missing = [a for a in scripts if not Path(a).is_file()]
    if missing:
        raise ConfigError(f"rollout.agent_command: {missing[0]!r} not found (relative to {Path.cwd()})")
    command = list(rollout.agent_command)
    return lambda: CommandAgent(command)


def agent_factory(rollout: RolloutConfig) -> Callable[[], BaseHarness]:
    """What constructs ``rollout.agent``'s harness (not ``agentcore``: actors/agentcore_launcher.py wires
    that one to the run's launcher). Raises ConfigError naming the field for anything that will not work."""
    name = rollout.agent
    if name == "python_tool_agent":
        from rayrl.agents.python_agent import PythonToolAgent

        _check_tools(rollout)
        options = python_agent_options(rollout)
        return lambda: PythonToolAgent(**options)
    if name == "chat":
        from rayrl.agents.chat_agent import ChatAgent

        return ChatAgent
    if name == "environment":  # rollout.environment runs the episodes (rayrl/environments/)
        from rayrl.environments import harness_factory, parse_ref

        parse_ref(rollout.environment or "")
        return harness_factory(rollout.environment or "", dict(rollout.environment_args), rollout.judge)
    if name == "claude_code":
        from rayrl.agents.claude_code import ClaudeCodeHarness

        return ClaudeCodeHarness
    if name == "codex":
        from rayrl.agents.codex import CodexHarness

        return CodexHarness
    if name == "command":
        return _command_factory(rollout)
    if name == "agentcore":
        raise ConfigError(f"{FIELD}: agentcore harnesses are built by the run's AgentCore launcher")
    if ":" not in name:
        raise ConfigError(f"{FIELD}: unknown agent {name!r}{did_you_mean(name, BUILT_IN)}; use one of "
                          f"{', '.join(BUILT_IN)} or package.module:function (docs/agents.md)")
    obj = load_reference(name, FIELD)
    if inspect.isclass(obj):
        return _class_factory(obj, rollout, name)
    check_call(obj, FIELD, name, ("task", "endpoint"), "agent(task, endpoint) -> str")
    from rayrl.agents.function_agent import FunctionAgent

    return lambda: FunctionAgent(obj, name)


def make_harness(name: str, **kwargs: Any) -> BaseHarness:
    """A built-in harness by name with explicit options (tests, notebooks, the AgentCore launcher, which
    passes ``launcher=``, ``cfg=`` and ``exp_id=``). A run builds its harness with :func:`agent_factory`."""
    if name == "python_tool_agent":
        from rayrl.agents.python_agent import PythonToolAgent

        return PythonToolAgent(**kwargs)
    if name == "chat":
        from rayrl.agents.chat_agent import ChatAgent

        return ChatAgent(**kwargs)
    if name == "claude_code":
        from rayrl.agents.claude_code import ClaudeCodeHarness

        return ClaudeCodeHarness(**kwargs)
    if name == "codex":
        from rayrl.agents.codex import CodexHarness

        return CodexHarness(**kwargs)
    if name == "agentcore":
        from rayrl.agents.agentcore.harness import AgentCoreHarness

        return AgentCoreHarness(**kwargs)
    if name == "command":
        from rayrl.agents.command_agent import CommandAgent

        return CommandAgent(**kwargs)
    raise ValueError(f"{FIELD}: no built-in harness {name!r} ({', '.join(BUILT_IN)})")


def check_agent(rollout: RolloutConfig) -> None:
    """Import and check ``rollout.agent`` (and ``rollout.agent_command``) at load; ConfigError otherwise."""
    if rollout.agent != "agentcore":
        agent_factory(rollout)


__all__ = ["AgentResult", "BaseHarness", "Endpoint", "EpisodeContext", "InfrastructureError", "agent_factory",
           "check_agent", "make_harness"]
