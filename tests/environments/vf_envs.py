"""verifiers environments written the way their authors write them (classic API), for the adapter's tests:
a rubric that raises, a multi-turn loop, a tool environment, and loaders that fail in the ways real ones do."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def _sums(n: int = 2) -> Dataset:
    return Dataset.from_list([{"question": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(n)])


def raising_rubric() -> vf.Environment:
    def always_raises(completion) -> float:
        return 1 / 0

    def fine(completion) -> float:
        return 1.0

    return vf.SingleTurnEnv(dataset=_sums(), rubric=vf.Rubric(funcs=[fine, always_raises]))


class DoubleCheck(vf.MultiTurnEnv):
    """Asks "Are you sure?" once, then stops."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(role="user", content="Are you sure?")]

    @vf.stop
    async def asked_once(self, state) -> bool:
        return len(state["trajectory"]) >= 2


def double_check() -> vf.Environment:
    def stays_right(completion, answer) -> float:
        replies = [getattr(m, "content", None) or m.get("content", "") if isinstance(m, dict) else m.content
                   for m in completion if (m.get("role") if isinstance(m, dict) else m.role) == "assistant"]
        return float(len(replies) == 2 and all(answer in r for r in replies))

    data = Dataset.from_list([{"question": "What is 2 + 2?", "answer": "4"}] * 2)
    return DoubleCheck(dataset=data, rubric=vf.Rubric(funcs=[stays_right]), max_turns=4)


def tool_sum() -> vf.Environment:
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    def correct(completion, answer) -> float:
        last = completion[-1]
        text = last.get("content") if isinstance(last, dict) else last.content
        return float(answer in (text or ""))

    def used_the_tool(completion) -> float:
        return float(any((m.get("role") if isinstance(m, dict) else m.role) == "tool" for m in completion))

    data = Dataset.from_list([{"question": "What is 5 + 7? Use the add tool.", "answer": "12"}])
    return vf.ToolEnv(dataset=data, tools=[add], rubric=vf.Rubric(funcs=[correct, used_the_tool], weights=[1.0, 0.0]),
                      max_turns=3)


def from_the_hub() -> vf.Environment:
    from datasets import load_dataset

    return vf.SingleTurnEnv(dataset=load_dataset("openai/gsm8k", "main", split="train"))


def broken_loader() -> vf.Environment:
    import os

    return vf.SingleTurnEnv(dataset=_sums(), system_prompt=os.environ["needs_an_api_key"])


def not_an_env() -> dict:
    return {"dataset": []}


def judged(judge_url: str = "http://127.0.0.1:9/v1") -> vf.Environment:
    """A JudgeRubric environment as published ones are: its own judge client and model (rollout.judge replaces
    them); the default URL has nothing listening."""
    from openai import AsyncOpenAI

    rubric = vf.JudgeRubric(judge_client=AsyncOpenAI(base_url=judge_url, api_key="none", max_retries=0),
                            judge_model="gpt-4.1-mini")

    async def judge_says_yes(judge, prompt, completion, answer, state) -> float:
        verdict = await judge(prompt, completion, answer, state)
        return 1.0 if "yes" in verdict.lower() else 0.0

    rubric.add_reward_func(judge_says_yes)
    return vf.SingleTurnEnv(dataset=_sums(), rubric=rubric)


def group_scored() -> vf.Environment:
    def best_of_group(completions) -> list[float]:
        return [1.0] * len(completions)

    return vf.SingleTurnEnv(dataset=_sums(), rubric=vf.Rubric(funcs=[best_of_group]))
