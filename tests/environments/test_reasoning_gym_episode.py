"""reasoning-gym's example through the real gateway: the chat agent answers, the dataset's score_answer scores."""

from __future__ import annotations

from pathlib import Path

from rayrl.config import ReasoningGymSource, load_config
from rayrl.data.reasoning_gym import ReasoningGymTasks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reasoning_gym" / "config.yaml"


def test_an_episode_of_the_chat_agent_is_scored_by_the_dataset(scripted):
    """The example's agent and reward through the real gateway (a scripted engine answers): the pipeline's
    episode path without Ray; tests/pipeline/test_environment_runs.py runs the example in a real run."""
    import re

    from rayrl.agents import agent_factory
    from rayrl.agents.episode import EpisodeRunner
    from rayrl.rewards import reward_fn_for
    from tests.gateway.episode_kit import InProcessSessions

    def script(prompt: str) -> str:
        a, op, b = re.findall(r"(\d+) ([-+]) (\d+) =", prompt)[-1]
        return f"Sure. <answer>{int(a) + int(b) if op == '+' else int(a) - int(b)}</answer>"

    cfg = load_config(EXAMPLE)
    stack = scripted(script)
    runner = EpisodeRunner(agent_factory(cfg.rollout)(), reward_fn_for(cfg.rollout), InProcessSessions(stack), None,
                           cfg.rollout, "tiny")
    task = ReasoningGymTasks([ReasoningGymSource(name="chain_sum", size=1, config=cfg.data.reasoning_gym[0].config)])[0]
    episode = runner.run(task, "g")
    assert episode.ok and episode.reward == 1.0, episode.error
    assert "Answer with the number only, inside <answer></answer>." in stack.engine.prompts[0]  # rollout.system_prompt
    assert task.prompt in stack.engine.prompts[0]
    assert stack.engine.sampling[0]["max_new_tokens"] == cfg.rollout.max_tokens == 64
