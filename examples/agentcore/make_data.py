"""Generate GSM8K-style word problems (multi-step arithmetic stories with integer answers).

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
        n, per, gave = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 10)
        q = f"{name} buys {n} {box} of {item} with {per} {item} in each. {name} gives away {gave} {item}. " \
            f"How many {item} does {name} have left?"
        return q, n * per - gave
    if kind == 1:
        price, n, paid = rng.randint(2, 9), rng.randint(2, 8), 100
        q = f"One {item[:-1]} costs ${price}. {name} buys {n} of them and pays with a ${paid} bill. " \
            f"How many dollars of change does {name} get?"
        return q, paid - price * n
    a, b, days = rng.randint(2, 15), rng.randint(2, 15), rng.randint(2, 7)
    q = f"{name} collects {a} {item} in the morning and {b} {item} in the afternoon every day. " \
        f"How many {item} does {name} collect in {days} days?"
    return q, (a + b) * days


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
