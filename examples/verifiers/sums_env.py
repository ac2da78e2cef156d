"""A verifiers environment as people write them (the classic API: ``import verifiers as vf``), with its
data built in code: add two small numbers. Nothing here knows rayrl; examples/verifiers/config.yaml runs it.

Two reward functions, as environments usually have: ``correct_answer`` (weight 1.0) and
``answer_format`` (weight 0.2: the reply is just a number); rayrl logs each as ``reward/<name>``.
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Answer with the number only."


def _rows(n: int, seed: int, hi: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def _number(text: str) -> str:
    words = (text or "").strip().rstrip(".").split()
    return words[-1] if words else ""


def correct_answer(completion, answer, parser) -> float:
    return 1.0 if _number(parser.parse_answer(completion) or "") == answer else 0.0


def answer_format(completion, parser) -> float:
    return 1.0 if (parser.parse_answer(completion) or "").strip().lstrip("-").isdigit() else 0.0


def load_environment(num_train: int = 400, num_eval: int = 32, max_operand: int = 20, seed: int = 0,
                     temperature: float | None = None) -> vf.Environment:
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[correct_answer, answer_format], weights=[1.0, 0.2], parser=parser)
    sampling = {"temperature": temperature} if temperature is not None else None
    return vf.SingleTurnEnv(dataset=Dataset.from_list(_rows(num_train, seed, max_operand)),
                            eval_dataset=Dataset.from_list(_rows(num_eval, seed + 1, max_operand)),
                            system_prompt=SYSTEM_PROMPT, parser=parser, rubric=rubric, sampling_args=sampling)
