"""Generate the calculator task set: short arithmetic questions with integer answers.

    python examples/calculator/make_data.py   # writes data/train.jsonl and data/val.jsonl

Each row follows the data contract: ``{"id", "prompt", "metadata": {"question", "answer"}}``; the
metadata is the agent's payload verbatim.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def make_question(rng: random.Random) -> tuple[str, int]:
    kind = rng.random()
    if kind < 0.4:
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        op = rng.choice(["+", "-", "*"])
        expr = f"{a} {op} {b}"
    elif kind < 0.7:
        a, b = rng.randint(12, 99), rng.randint(3, 19)
        expr = f"{a} * {b}"
    else:
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 12)
        op = rng.choice(["+", "-"])
        expr = f"({a} {op} {b}) * {c}"
    value = eval(expr)  # our own generated arithmetic, not user input
    return expr, int(value)


def main() -> None:
    rng = random.Random(1234)
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    seen: set[str] = set()
    rows = []
    while len(rows) < 600:
        expr, value = make_question(rng)
        if expr in seen:
            continue
        seen.add(expr)
        question = f"What is {expr}?"
        rows.append({"id": f"calc-{len(rows):04d}", "prompt": question,
                     "metadata": {"question": question, "answer": value}})
    for name, part in (("train.jsonl", rows[:500]), ("val.jsonl", rows[500:])):
        with (out / name).open("w") as fh:
            for row in part:
                fh.write(json.dumps(row) + "\n")
    print(f"wrote {out}/train.jsonl (500) and val.jsonl (100)")


if __name__ == "__main__":
    main()
