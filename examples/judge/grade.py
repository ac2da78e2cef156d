"""The judge function of examples/judge/config.yaml: the judge model reads the reply, the code compares.

A judge as small as SmolLM2-135M cannot grade: asked "is the student answer correct? yes or no", it said
"no" to right and wrong answers alike, so every group's rewards were equal and nothing trained. It can
read, though: shown worked examples as earlier turns, it copies the final number out of a free-form reply ("The answer
is 41." -> 41) reliably; a worked example in prose keeps it copying, not chatting, when the reply
is a paragraph. So this function asks the judge only for that number and compares it with the
task's reference answer itself. The same split (a model that extracts, code that checks) suits any judge
that reads better than it reasons; a judge that can grade needs no function (examples/judge/endpoint.yaml).

Wired as ``rollout.judge.function: examples.judge.grade:reads_the_answer``; the run's judge bounds, retries
and records each call. A reply the judge finds no number in scores 0; a judge reply that is neither a
number nor "none" is no verdict (JudgeError: the episode is ``judge_failed``, left out, never a 0).
"""

from __future__ import annotations

import re
from typing import Any

from rayrl.rl.failures import JudgeError
from rayrl.types import Task

INSTRUCTION = "Copy the final number from the text. Reply with the number only, or none if it has no number."
WORKED = [("The answer is 41.", "41"), ("12", "12"), ("I am not sure.", "none"),
          ("To find 7 + 5, we add them. So 7 + 5 = 12, which is the result.", "12")]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def messages_for(reply: str) -> list[dict[str, str]]:
    """The judge's conversation: the instruction, the worked examples as earlier turns, then the reply."""
    messages = [{"role": "system", "content": INSTRUCTION}]
    for text, number in WORKED:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": number}]
    messages.append({"role": "user", "content": reply})
    return messages


def reads_the_answer(task: Task, result: Any, judge: Any) -> float:
    """1.0 when the number the judge reads in the final answer equals ``task.metadata["answer"]``, else 0.0."""
    reply = (result.final_answer or "").strip()
    if not reply:
        return 0.0
    read = judge.ask(messages_for(reply)).strip()
    match = NUMBER.search(read)
    if match is None:
        if read.lower().startswith("none"):
            return 0.0
        raise JudgeError(f"the judge read no number and did not say none: {' '.join(read.split())[:200]!r}")
    return 1.0 if float(match.group()) == float(task.metadata["answer"]) else 0.0
