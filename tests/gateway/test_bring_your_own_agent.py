"""Bring your own agent (docs/agents.md): the plain forms plug in, and what they raise is classified.

Real episodes without Ray: EpisodeRunner drives the agent built from a RolloutConfig exactly as a rollout
worker does (``agent_factory``), against a real gateway in front of the scripted engine (a real HTTP server
speaking SGLang's /generate, tests/gateway/scripted_engine.py). The agents are the example's own
(examples/unit_convert: an async function over the openai SDK, and the same loop as a standalone program
that reads its endpoint from the environment) and small ones that fail on purpose (tests/byo_agents.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from rayrl.agents import agent_factory
from rayrl.agents.command_agent import STDERR_KEEP_CHARS, stderr_tail
from rayrl.agents.episode import EpisodeRunner
from rayrl.config import RolloutConfig
from rayrl.rewards import get_reward_fn
from rayrl.rl.failures import AGENT_CRASHED, REWARD_FAILED, SERVICE_FAILED, TIMED_OUT, is_infra, is_scored
from rayrl.types import Task
from tests.gateway.episode_kit import InProcessSessions

TASK = Task("Convert 3 feet to centimeters.", {"value": 3, "from_unit": "foot", "to_unit": "cm", "answer": 91.44},
            task_id="feet-cm")
CALL = '<tool_call>{"name": "convert", "arguments": {"value": 3, "from_unit": "feet", "to_unit": "cm"}}</tool_call>'
REWARD = "examples.unit_convert.reward:reward"
PROGRAM = ["python", "examples/unit_convert/agent_program.py"]


def _script(answer: str = "3 feet is 91.44 centimeters."):
    """Calls the tool first; answers once the tool's output is in the prompt."""
    return lambda prompt: answer if "91.44" in prompt.split("Convert 3 feet")[-1] else CALL


def _run(stack: Any, agent: str, reward: str = REWARD, command: list[str] | None = None, timeout_s: float = 60.0,
         index: int = 0):
    cfg = RolloutConfig(agent=agent, agent_command=command or [], reward=reward, max_turns=3, max_tokens=64,
                        episode_timeout_s=timeout_s, temperature=0.0)
    harness = agent_factory(cfg)()
    assert not harness.needs_sandbox  # the plain forms lease no sandbox: their tools are their own
    runner = EpisodeRunner(harness, get_reward_fn(reward), InProcessSessions(stack), None, cfg, "tiny")
    return runner.run(TASK, "g", index)


@pytest.mark.parametrize("agent, command", [("examples.unit_convert.agent:solve", None), ("command", PROGRAM),
                                            ("tests.byo_agents:plain_def", None)],
                         ids=["async-function", "program-reading-its-env", "plain-def"])
def test_the_plain_forms_run_the_example_agent(scripted, agent, command):
    stack = scripted(_script())
    episode = _run(stack, agent, command=command)
    assert episode.ok and episode.reward == 1.0, episode.error
    assert episode.info["final_answer"] == "3 feet is 91.44 centimeters."
    assert episode.info["turns"] == 2  # counted by the gateway: the agent reports nothing but its answer
    assert episode.info["tool_calls"] == 1  # the model's one convert call, as the gateway recorded it
    assert len(episode.samples) == 1 and episode.samples[0].num_trained_tokens > 0  # both calls, one sample


def test_a_wrong_answer_is_scored_zero(scripted):
    episode = _run(scripted(_script("3 feet is 12 centimeters.")), "examples.unit_convert.agent:solve")
    assert episode.ok and episode.reward == 0.0


def test_an_agent_that_raises_counts_against_the_task_with_its_cause(scripted):
    episode = _run(scripted(_script()), "tests.byo_agents:crashes_after_one_call")
    assert episode.failure == AGENT_CRASHED and is_scored(episode) and not is_infra(episode)
    assert episode.reward == 0.0  # the reward saw status "error" and gave 0
    assert episode.error.startswith("agent_crashed: KeyError: 'unit_label' (") and "byo_agents.py:" in episode.error
    assert episode.samples  # its one LLM call trains, with the group's advantage for reward 0


def test_what_a_reward_raises(scripted):
    stack = scripted(_script())
    broken = _run(stack, "examples.unit_convert.agent:solve", reward="tests.byo_agents:reward_with_a_bug")
    assert broken.failure == REWARD_FAILED and broken.reward == 0.0 and is_scored(broken)
    assert "ZeroDivisionError" in broken.error
    grader_down = _run(stack, "examples.unit_convert.agent:solve", reward="tests.byo_agents:reward_grader_down")
    assert grader_down.failure == SERVICE_FAILED and is_infra(grader_down) and "grader" in grader_down.error


def test_a_program_says_infrastructure_with_exit_code_75(scripted):
    stack = scripted(_script())
    infra = _run(stack, "command", command=["python", "tests/byo_agents.py", "75"])
    assert infra.failure == SERVICE_FAILED and is_infra(infra) and "exited with 75: service down" in infra.error
    crash = _run(stack, "command", command=["python", "tests/byo_agents.py", "3"])
    assert crash.failure == AGENT_CRASHED and is_scored(crash) and crash.reward == 0.0
    assert infra.info["stderr"] == "service down" and crash.info["stderr"] == "agent bug"


def test_a_programs_stderr_is_kept_with_every_episode_bounded(scripted):
    """Issue 43: where a program agent's stderr goes. A success keeps it too (exit 0 after a warning)."""
    done = _run(scripted(_script()), "command", command=["python", "tests/byo_agents.py", "0"])
    assert done.ok and done.info["stderr"] == "agent bug"
    long = "x" * (STDERR_KEEP_CHARS + 10) + "END"
    assert stderr_tail(long) == "…" + long[-STDERR_KEEP_CHARS:] and stderr_tail("warn\n") == "warn"


def test_an_async_agent_is_cancelled_at_the_deadline(scripted):
    episode = _run(scripted(_script()), "tests.byo_agents:sleeps", timeout_s=2.0)
    assert episode.failure == TIMED_OUT and is_infra(episode) and "cancelled at the episode deadline" in episode.error
