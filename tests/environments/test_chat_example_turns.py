"""``rollout.example_turns``: the chat agent's worked examples as earlier turns, checked at load and sent in order.

What reaches the engine is read from the real gateway's rendered prompt (a scripted engine answers), so an
order or role mix-up in the agent shows here, not only in the messages it builds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rayrl.agents.base import AgentResult, BaseHarness
from rayrl.agents.chat_agent import ChatAgent
from rayrl.config import ConfigError, load_config
from rayrl.preflight import preflight

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reasoning_gym" / "config.yaml"
TURNS = "rollout.example_turns=[{user: 'What is 12 + 5?', assistant: '<answer>17</answer>'}, " \
        "{user: 'What is 40 - 8?', assistant: '<answer>32</answer>'}]"


def test_the_examples_are_sent_as_earlier_turns_between_system_and_task(scripted, tiny_tokenizer):
    from rayrl.agents import agent_factory
    from rayrl.agents.episode import EpisodeRunner
    from rayrl.rewards import reward_fn_for
    from rayrl.types import Task
    from tests.gateway.episode_kit import InProcessSessions

    cfg = load_config(EXAMPLE, [TURNS, "rollout.reward=calculator"])
    stack = scripted(lambda prompt: "<answer>7</answer>")
    runner = EpisodeRunner(agent_factory(cfg.rollout)(), reward_fn_for(cfg.rollout), InProcessSessions(stack), None,
                           cfg.rollout, "tiny")
    episode = runner.run(Task(prompt="What is 3 + 4?", metadata={"answer": "7"}, task_id="t"), "g")
    assert episode.ok, episode.error
    expected = [{"role": "system", "content": cfg.rollout.system_prompt},
                {"role": "user", "content": "What is 12 + 5?"}, {"role": "assistant", "content": "<answer>17</answer>"},
                {"role": "user", "content": "What is 40 - 8?"}, {"role": "assistant", "content": "<answer>32</answer>"},
                {"role": "user", "content": "What is 3 + 4?"}]
    rendered = tiny_tokenizer.apply_chat_template(expected, tokenize=False, add_generation_prompt=True)
    assert stack.engine.prompts == [rendered]


def test_without_examples_the_task_follows_the_system_prompt(scripted, tiny_tokenizer):
    from rayrl.agents import agent_factory
    from rayrl.agents.episode import EpisodeRunner
    from rayrl.rewards import reward_fn_for
    from rayrl.types import Task
    from tests.gateway.episode_kit import InProcessSessions

    cfg = load_config(EXAMPLE, ["rollout.reward=calculator", "rollout.example_turns=[]"])
    stack = scripted(lambda prompt: "<answer>7</answer>")
    runner = EpisodeRunner(agent_factory(cfg.rollout)(), reward_fn_for(cfg.rollout), InProcessSessions(stack), None,
                           cfg.rollout, "tiny")
    assert runner.run(Task(prompt="What is 3 + 4?", metadata={"answer": "7"}, task_id="t"), "g").ok
    expected = [{"role": "system", "content": cfg.rollout.system_prompt}, {"role": "user", "content": "What is 3 + 4?"}]
    assert stack.engine.prompts == [tiny_tokenizer.apply_chat_template(expected, tokenize=False,
                                                                       add_generation_prompt=True)]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.example_turns=[{user: a}]"], "rollout.example_turns[0].assistant: must be a non-empty string"),
        (["rollout.example_turns=[{user: a, assistant: ' '}]"], "rollout.example_turns[0].assistant: must be"),
        (["rollout.example_turns=[{user: a, assistant: b}, {assistant: b}]"], "rollout.example_turns[1].user: must"),
        (["rollout.example_turns=[{user: a, assistant: b, system: c}]"], "rollout.example_turns[0].system: unknown"),
        (["rollout.example_turns=[a]"], "rollout.example_turns: "),
        (["rollout.example_turns={user: a, assistant: b}"], "rollout.example_turns: "),
        (["rollout.example_turns=[{user: a, assistant: [b]}]"], "rollout.example_turns[0]"),
        ([TURNS, "rollout.agent=python_tool_agent"], "rollout.example_turns: the python_tool_agent agent does not"),
        ([TURNS, "rollout.agent=tests.environments.test_chat_example_turns:plain_agent"],
         "rollout.example_turns: tests.environments.test_chat_example_turns:plain_agent does not read it"),
        ([TURNS, "rollout.agent=tests.environments.test_chat_example_turns:PlainHarness"],
         "rollout.example_turns: tests.environments.test_chat_example_turns:PlainHarness does not read it"),
    ],
)
def test_a_wrong_example_turn_or_an_agent_that_ignores_them_names_the_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        preflight(load_config(EXAMPLE, overrides))
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_a_chat_agent_subclass_gets_the_examples():
    from rayrl.agents import agent_factory

    cfg = load_config(EXAMPLE, [TURNS, "rollout.agent=tests.environments.test_chat_example_turns:MyChat"])
    preflight(cfg)
    assert agent_factory(cfg.rollout)().example_turns == [("What is 12 + 5?", "<answer>17</answer>"),
                                                          ("What is 40 - 8?", "<answer>32</answer>")]


def plain_agent(task, endpoint) -> str:
    """A function agent: it builds its own messages, so it cannot take the examples."""
    return "4"


class PlainHarness(BaseHarness):
    """A harness of one's own that is not a ChatAgent."""

    def run(self, task, ctx):
        return AgentResult(final_answer="4")


class MyChat(ChatAgent):
    """A ChatAgent subclass: it is built with the examples, as the chat agent is."""
