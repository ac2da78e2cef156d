"""The unit-conversion reward: 1.0 when the answer's last number is within 1% of the right value, else 0.0.

rayrl calls ``reward(task, result)`` for every episode the agent finished or failed by its own doing
(``rollout.reward: examples.unit_convert.reward:reward``). ``task.metadata`` is the dataset row's
metadata (``answer``: the exact converted value); ``result.final_answer`` is the string the agent
returned, ``result.status`` "completed", "max_turns" or "error" (the agent raised: no answer to score).
"""

from __future__ import annotations

import re
from typing import Any

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
TOLERANCE = 0.01  # relative: the tool rounds to 4 significant digits, the model may round a bit more


def reward(task: Any, result: Any) -> float:
    if result.status != "completed" or not result.final_answer:
        return 0.0
    numbers = NUMBER.findall(result.final_answer.replace(",", ""))
    if not numbers:
        return 0.0
    expected = float(task.metadata["answer"])
    return 1.0 if abs(float(numbers[-1]) - expected) <= TOLERANCE * abs(expected) else 0.0
