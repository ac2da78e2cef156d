"""What driver.py checks before Ray starts (rayrl/preflight.py), in process: each mistake in your own agent,
reward, callback, tools or agent command is a ConfigError naming the field, on one line.
tests/test_driver_cli.py runs a few of them through driver.py (exit 2, no traceback, no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayrl.agents import agent_factory
from rayrl.agents.python_agent import PythonToolAgent
from rayrl.config import ConfigError, load_config
from rayrl.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "examples" / "unit_convert" / "config.yaml"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.agent=examples.unit_convert.agnt:solve"],
         "rollout.agent: no module named 'examples.unit_convert.agnt'"),
        (["rollout.agent=examples.unit_convert.agent:solv"],
         "rollout.agent: module 'examples.unit_convert.agent' has no 'solv' (did you mean 'solve'?)"),
        (["rollout.agent=examples.unit_convert.agent"], "rollout.agent: unknown agent 'examples.unit_convert.agent'"),
        (["rollout.reward=examples.unit_convert.reward:rewrd"], "rollout.reward: module"),
        (["rollout.agent=tests.byo_agents:agent_takes_three_arguments"],
         "rollout.agent: tests.byo_agents:agent_takes_three_arguments(task, endpoint, extra) cannot be called as "
         "agent(task, endpoint)"),
        (["rollout.reward=tests.byo_agents:reward_takes_one_argument"],
         "rollout.reward: tests.byo_agents:reward_takes_one_argument(result) cannot be called as reward(task, result)"),
        (["rollout.agent=tests.byo_agents:NeedsArguments"],
         "rollout.agent: tests.byo_agents:NeedsArguments is a class but not a rayrl.agents.BaseHarness"),
        (["rollout.agent=tests.byo_agents:TOOL_LIMIT"],
         "rollout.agent: 'tests.byo_agents:TOOL_LIMIT' is a int, not a function"),
        (["rollout.agent=pyhton_tool_agent"],
         "rollout.agent: unknown agent 'pyhton_tool_agent' (did you mean 'python_tool_agent'?)"),
        (["rollout.reward=calculater"], "rollout.reward: unknown reward 'calculater' (did you mean 'calculator'?)"),
        (["rollout.agent=python_tool_agent", "rollout.tools=[calculater]"],
         "rollout.tools: unknown tool 'calculater' (did you mean 'calculator'?)"),
        (["rollout.agent=command"], "rollout.agent_command: rollout.agent command needs the program to run"),
        (["rollout.agent=command", "rollout.agent_command=[python,examples/unit_convert/agent_progam.py]"],
         "rollout.agent_command: 'examples/unit_convert/agent_progam.py' not found"),
        (["rollout.agent=command", "rollout.agent_command=[no-such-program-i27]"],
         "rollout.agent_command: 'no-such-program-i27' is not an executable on PATH or a file"),
        (["rollout.agent_command=[python,x.py]"], "rollout.agent_command: only read with rollout.agent: command"),
        (["trajectory.debug_callback=tests.byo_agents:reward_with_a_bug"],
         "trajectory.debug_callback: tests.byo_agents:reward_with_a_bug(task, result) cannot be called as "
         "callback(event)"),
    ],
)
def test_each_mistake_names_its_field_on_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        preflight(load_config(UNIT, overrides), data=False)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_the_three_forms_and_the_built_ins_pass():
    for overrides in ([], ["rollout.agent=command",
                           "rollout.agent_command=[python,examples/unit_convert/agent_program.py]"],
                      ["rollout.agent=tests.e2e_support:FlakyAgent"], ["rollout.agent=tests.byo_agents:plain_def"],
                      ["rollout.agent=python_tool_agent"], ["rollout.agent=claude_code"], ["rollout.agent=codex"]):
        preflight(load_config(UNIT, overrides))


def test_classes_get_only_the_arguments_they_asked_for():
    cfg = load_config(UNIT, ["rollout.agent=tests.e2e_support:FlakyAgent", "rollout.tools=[calculator,search]",
                             "rollout.few_shot_examples=1"])
    flaky = agent_factory(cfg.rollout)()  # a PythonToolAgent subclass: the python agent's options
    assert isinstance(flaky, PythonToolAgent) and flaky.tool_names == ["calculator", "search"]
    assert flaky.few_shot_examples == 1
    slow = agent_factory(load_config(UNIT, ["rollout.agent=tests.pipeline.pipeline_support:SlowToolAgent"]).rollout)()
    assert slow.needs_sandbox  # constructed with no arguments
    claude = agent_factory(load_config(UNIT, ["rollout.agent=claude_code"]).rollout)()
    assert claude.name == "claude_code"  # used to die with TypeError: few_shot_examples


def test_a_harness_that_needs_arguments_of_its_own_is_refused(tmp_path, monkeypatch):
    (tmp_path / "needs_args_agent.py").write_text(
        "from rayrl.agents import BaseHarness, AgentResult\n\n"
        "class NeedsModelDir(BaseHarness):\n"
        "    def __init__(self, model_dir):\n        self.model_dir = model_dir\n\n"
        "    def run(self, task, ctx):\n        return AgentResult()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"rollout.agent: needs_args_agent:NeedsModelDir\(\) "
                                          r"cannot be constructed with the arguments rayrl passes \(none\)"):
        preflight(load_config(UNIT, ["rollout.agent=needs_args_agent:NeedsModelDir"]), data=False)
