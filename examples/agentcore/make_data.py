"""Generate GSM8K-style word problems: one-step stories (add, give away, groups of) with small numbers.

One step, because SmolLM2-135M-Instruct, the CPU model, solved 2 of 160 two-step problems (a first
version of this file) and so trained nothing; on these it gets about half right with the agent's worked
examples, so GRPO has groups with both right and wrong answers to learn from. For a real model, convert
real GSM8K instead (below).

    python examples/agentcore/make_data.py       # writes data/train.jsonl and data/val.jsonl

Rows follow the data contract: ``{"id", "prompt", "metadata": {"prompt", "answer"}}``. ``metadata`` is
the agent's payload verbatim (the math agent reads ``payload["prompt"]``; the gsm8k reward reads
``answer``); the top-level ``prompt`` only drives length filtering. Real GSM8K rows convert the same way:
``{"prompt": q, "metadata": {"prompt": q, "answer": solution}}`` (the reward reads ``#### <n>``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jon"]
ITEMS = [("apples", "bags"), ("stickers", "sheets"), ("pencils", "boxes"), ("cookies", "trays"), ("marbles", "jars")]


def make_problem(rng: random.Random) -> tuple[str, int]:
    name, (item, box) = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?", a + b
    if kind == 1:
        a = rng.randint(6, 15)
        b = rng.randint(2, 5)
        return f"{name} has {a} {item} and gives away {b} of them. How many {item} does {name} have left?", a - b
    n, per = rng.randint(2, 5), rng.randint(2, 10)
    return f"{name} has {n} {box} with {per} {item} in each. How many {item} does {name} have?", n * per


def main() -> None:
    rng = random.Random(2026)
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    rows, seen = [], set()
    while len(rows) < 240:
        q, answer = make_problem(rng)
        if q in seen:
            continue
        seen.add(q)
        rows.append({"id": f"gsm-{len(rows):04d}", "prompt": q, "metadata": {"prompt": q, "answer": str(answer)}})
    for name, part in (("train", rows[:200]), ("val", rows[200:])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()
