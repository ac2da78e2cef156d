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
``rollout.agent``, never a TypeError inside a worker. The built-in harnesses are one table,
:data:`HARNESSES` (a :class:`Harness` row each, with its traits); nothing else compares their names.
"""

from __future__ import annotations

import importlib
import inspect
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from rayrl.agents.base import AgentResult, BaseHarness, Endpoint, EpisodeContext
from rayrl.config import ConfigError, RolloutConfig
from rayrl.config.rollout import ENVIRONMENT
from rayrl.extensions import check_call, did_you_mean, load_reference
from rayrl.rl.failures import InfrastructureError

FIELD = "rollout.agent"


def python_agent_options(rollout: RolloutConfig) -> dict[str, Any]:
    """The python tool-use agent's constructor arguments from ``rollout.*``."""
    options: dict[str, Any] = {"tools": list(rollout.tools), "few_shot_examples": rollout.few_shot_examples}
    if rollout.tool_delay_s:
        options["tool_delay_s"] = list(rollout.tool_delay_s)
    return options


def chat_agent_options(rollout: RolloutConfig) -> dict[str, Any]:
    """The chat agent's constructor arguments from ``rollout.*``: its worked examples as (user, assistant) pairs."""
    return {"example_turns": [(turn["user"], turn["assistant"]) for turn in rollout.example_turns]}


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
    from rayrl.agents.chat_agent import ChatAgent

    kwargs: dict[str, Any] = {}
    if issubclass(cls, PythonToolAgent):
        _check_tools(rollout)
        kwargs = python_agent_options(rollout)
    elif issubclass(cls, ChatAgent):
        kwargs = chat_agent_options(rollout)
    elif rollout.example_turns:
        raise ConfigError(f"rollout.example_turns: {ref} does not read it (only the chat agent and its subclasses "
                          "do); unset it or put the examples in your agent")
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


def _python_tool_agent(rollout: RolloutConfig) -> Callable[[], BaseHarness]:
    _check_tools(rollout)
    options = python_agent_options(rollout)
    return lambda: HARNESSES["python_tool_agent"].harness_class()(**options)


def _chat_agent(rollout: RolloutConfig) -> Callable[[], BaseHarness]:
    options = chat_agent_options(rollout)
    return lambda: HARNESSES["chat"].harness_class()(**options)


@dataclass(frozen=True)
class Harness:
    """One built-in harness (``rollout.agent``) and its traits (a row of :data:`HARNESSES`).

    ``implementation``: ``module:Class`` of its :class:`BaseHarness`, imported when one is built (None: it
    has no class of its own to build by name). ``factory``: what builds it for a run from ``rollout.*``,
    checking what it reads (None: the class, with no arguments; a ``module:function`` string: that function,
    imported when a run builds the harness, as for the environment row, which rayrl/environments implements).
    ``reads_command``: it runs ``rollout.agent_command``. ``run_launcher``: the run's AgentCore launcher actor builds it
    (actors/agentcore_launcher.py) and the ``agentcore`` section must say where it runs. ``uses_sandboxes``:
    its episodes lease sandboxes from the pool (sandbox_pool.max_size bounds them). ``from_environment``: the
    harness ``rollout.environment`` sets (its rubric runs the episodes); ``rollout.agent`` does not name it itself.
    ``reads_example_turns``: it sends ``rollout.example_turns`` before the task (set for any other, a config error).
    """

    name: str
    implementation: Optional[str]
    factory: Optional[Callable[[RolloutConfig], Callable[[], BaseHarness]] | str] = None
    reads_command: bool = False
    run_launcher: bool = False
    uses_sandboxes: bool = True
    from_environment: bool = False
    reads_example_turns: bool = False

    def harness_class(self) -> type:
        """The class that implements it (imported now)."""
        if self.implementation is None:
            raise ValueError(f"{FIELD}: {self.name} has no harness class to build by name")
        module, _, name = self.implementation.partition(":")
        return getattr(importlib.import_module(module), name)


HARNESSES: dict[str, Harness] = {row.name: row for row in (
    Harness("python_tool_agent", "rayrl.agents.python_agent:PythonToolAgent", _python_tool_agent),
    Harness("chat", "rayrl.agents.chat_agent:ChatAgent", _chat_agent, reads_example_turns=True),
    Harness("claude_code", "rayrl.agents.claude_code:ClaudeCodeHarness"),
    Harness("codex", "rayrl.agents.codex:CodexHarness"),
    Harness("agentcore", "rayrl.agents.agentcore.harness:AgentCoreHarness", run_launcher=True, uses_sandboxes=False),
    Harness("command", "rayrl.agents.command_agent:CommandAgent", lambda rollout: _command_factory(rollout),
            reads_command=True),
    Harness(ENVIRONMENT, None, "rayrl.environments:environment_harness", from_environment=True),  # rollout.environment
)}
BUILT_IN = tuple(row.name for row in HARNESSES.values() if not row.from_environment)  # what rollout.agent may name


def harness_row(name: str) -> Optional[Harness]:
    """The row ``name`` (``rollout.agent``), or None for a ``package.module:name`` of your own."""
    return HARNESSES.get(name)


def agent_factory(rollout: RolloutConfig) -> Callable[[], BaseHarness]:
    """What constructs ``rollout.agent``'s harness (not one the run's launcher builds: actors/agentcore_launcher.py
    wires that one). Raises ConfigError naming the field for anything that will not work."""
    name = rollout.agent
    row = harness_row(name)
    if row is not None and row.run_launcher:
        raise ConfigError(f"{FIELD}: {name} harnesses are built by the run's AgentCore launcher")
    if row is not None and row.factory is None:
        return row.harness_class()
    if row is not None:
        factory = load_reference(row.factory, FIELD) if isinstance(row.factory, str) else row.factory
        return factory(rollout)
    if ":" not in name:
        raise ConfigError(f"{FIELD}: unknown agent {name!r}{did_you_mean(name, BUILT_IN)}; use one of "
                          f"{', '.join(BUILT_IN)} or package.module:function (docs/agents.md)")
    obj = load_reference(name, FIELD)
    if inspect.isclass(obj):
        return _class_factory(obj, rollout, name)
    check_call(obj, FIELD, name, ("task", "endpoint"), "agent(task, endpoint) -> str")
    if rollout.example_turns:
        raise ConfigError(f"rollout.example_turns: {name} does not read it (a function agent builds its own "
                          "messages); unset it or put the examples in your agent")
    from rayrl.agents.function_agent import FunctionAgent

    return lambda: FunctionAgent(obj, name)


def make_harness(name: str, **kwargs: Any) -> BaseHarness:
    """A built-in harness by name with explicit options (tests, notebooks, the AgentCore launcher, which
    passes ``launcher=``, ``cfg=`` and ``exp_id=``). A run builds its harness with :func:`agent_factory`."""
    row = harness_row(name)
    if row is None or row.implementation is None:
        raise ValueError(f"{FIELD}: no built-in harness {name!r} ({', '.join(BUILT_IN)})")
    return row.harness_class()(**kwargs)


def check_agent(rollout: RolloutConfig) -> None:
    """Import and check ``rollout.agent`` (and ``rollout.agent_command``) at load; ConfigError otherwise."""
    row = harness_row(rollout.agent)
    if rollout.example_turns and row is not None and not row.reads_example_turns:
        raise ConfigError(f"rollout.example_turns: the {rollout.agent} agent does not read it (the chat agent "
                          "does); unset it")
    if row is None or not row.run_launcher:
        agent_factory(rollout)


__all__ = ["HARNESSES", "AgentResult", "BaseHarness", "Endpoint", "EpisodeContext", "Harness", "InfrastructureError",
           "agent_factory", "check_agent", "harness_row", "make_harness"]
