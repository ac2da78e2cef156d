"""Writes data/train.jsonl (400 tasks) and data/val.jsonl (100 held-out tasks): unit conversions.

Each row is what rayrl reads (docs/agents.md): ``prompt`` is the question the agent gets as
``task.prompt``; ``metadata`` is handed to the agent and the reward as ``task.metadata`` (here the exact
answer the reward checks, and the quantity for anyone reading the data); ``id`` names the task.

    python examples/unit_convert/make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# (unit as the tool knows it, its name in a question), by dimension
UNITS = {
    "length": [("mm", "millimeters"), ("cm", "centimeters"), ("m", "meters"), ("km", "kilometers"),
               ("inch", "inches"), ("foot", "feet"), ("yard", "yards"), ("mile", "miles")],
    "mass": [("g", "grams"), ("kg", "kilograms"), ("oz", "ounces"), ("lb", "pounds")],
    "volume": [("ml", "milliliters"), ("l", "liters"), ("cup", "cups"), ("gallon", "gallons")],
}
FACTORS = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "inch": 0.0254, "foot": 0.3048, "yard": 0.9144,
           "mile": 1609.344, "g": 0.001, "kg": 1.0, "oz": 0.028349523125, "lb": 0.45359237, "ml": 0.001,
           "l": 1.0, "cup": 0.2365882365, "gallon": 3.785411784}
TEMPLATES = ["Convert {v} {src} to {dst}.", "How many {dst} are in {v} {src}?", "What is {v} {src} in {dst}?"]


def task(rng: random.Random, n: int, split: str) -> dict | None:
    """One task, or None when its answer would be awkward to write (under 0.01 or over 9999)."""
    dimension = rng.choice(sorted(UNITS))
    (src, src_name), (dst, dst_name) = rng.sample(UNITS[dimension], 2)
    value = rng.choice([rng.randint(1, 20), round(rng.uniform(0.5, 50), 1)])
    answer = value * FACTORS[src] / FACTORS[dst]
    if not 0.01 <= answer <= 9999:
        return None
    question = rng.choice(TEMPLATES).format(v=f"{value:g}", src=src_name, dst=dst_name)
    return {"id": f"{split}-{n:04d}", "prompt": question,
            "metadata": {"value": value, "from_unit": src, "to_unit": dst, "answer": answer}}


def main() -> None:
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    rng = random.Random(27)
    seen: set[str] = set()
    for split, count in (("train", 400), ("val", 100)):
        rows = []
        while len(rows) < count:
            row = task(rng, len(rows), split)
            if row is not None and row["prompt"] not in seen:  # held-out questions never repeat training ones
                seen.add(row["prompt"])
                rows.append(row)
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {out / f'{split}.jsonl'}: {len(rows)} tasks")


if __name__ == "__main__":
    main()
