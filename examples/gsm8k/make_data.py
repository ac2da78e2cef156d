"""Convert GSM8K (the Hugging Face parquet or the original JSONL) into rayrl task rows.

    python examples/gsm8k/make_data.py --input gsm8k/main/train-00000-of-00001.parquet --out data/train.jsonl
    python examples/gsm8k/make_data.py --input grade_school_math/data/test.jsonl --out data/test.jsonl

Input rows have ``question`` and ``answer`` (a worked solution ending in ``#### <number>``). Output rows
follow the data contract: ``{"id", "prompt", "metadata": {"question", "answer", "solution"}}``, where
``answer`` is the final number (what the ``gsm8k`` reward compares with) and ``solution`` the worked text.
Parquet needs pyarrow (``pip install pyarrow``); JSONL needs nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

_FINAL = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)\s*$")


class GSM8KFormatError(ValueError):
    """An input row without a question or without a ``#### <number>`` answer."""


def final_number(solution: str) -> int | float:
    match = _FINAL.search(solution.strip())
    if not match:
        raise GSM8KFormatError(f"no '#### <number>' at the end of the answer: {solution[-80:]!r}")
    raw = match.group(1).replace(",", "")
    value = float(raw)
    return int(value) if value.is_integer() else value


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            sys.exit("reading parquet needs pyarrow: pip install pyarrow (or convert to JSONL first)")
        yield from pq.read_table(path, columns=["question", "answer"]).to_pylist()
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise GSM8KFormatError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None


def convert(rows: Iterator[dict[str, Any]], prefix: str) -> Iterator[dict[str, Any]]:
    for i, row in enumerate(rows):
        question, solution = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not isinstance(solution, str):
            raise GSM8KFormatError(f"row {i}: needs string fields 'question' and 'answer'")
        yield {
            "id": f"{prefix}-{i:05d}",
            "prompt": question.strip(),
            "metadata": {"question": question.strip(), "answer": final_number(solution), "solution": solution},
        }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", required=True, type=Path, help="GSM8K .parquet or .jsonl")
    ap.add_argument("--out", required=True, type=Path, help="rayrl task JSONL to write")
    ap.add_argument("--limit", type=int, default=0, help="keep only the first N rows (0: all)")
    args = ap.parse_args(argv)
    prefix = "gsm8k-" + args.input.stem.split("-")[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(args.out, "w", encoding="utf-8") as out:
        for row in convert(read_rows(args.input), prefix):
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
            if args.limit and count >= args.limit:
                break
    print(f"wrote {count} tasks to {args.out}")


if __name__ == "__main__":
    main()
