"""Does recording a turn cost more in a long session? ``TrajectoryTree.record_turn`` at 100, 1,000 and
3,000 earlier turns, for three session shapes.

    python bench/session_length.py [--turns 100 1000 3000] [--quick]

Shapes: the overhead bench's (bench/gateway_overhead.py sends one conversation over and over in one
session: the same prompt, the same answer), a prompt retried with a different sampled answer each time,
and a fresh conversation under one system prompt on every call (a coding agent's side calls). Reported
per shape and session length: the median time of one ``record_turn`` over a block of calls, and the
message comparisons (``messages_equal`` calls) it made, which the machine's load cannot change. A
per-call cost that grows with the session's length shows in both; the comparisons say why.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np
from measure import Record, add_common_args

import rayrl.trajectory.tree as tree_mod
from rayrl.trajectory import TrajectoryTree, messages_equal
from rayrl.types import TurnRecord

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is the capital of France? Answer in one word."}
PROMPT = np.arange(30, dtype=np.int32)


def _turn(messages: list[dict[str, Any]], answer: str) -> TurnRecord:
    return TurnRecord(messages=[dict(m) for m in messages], response_message={"role": "assistant", "content": answer},
                      prompt_ids=PROMPT.copy(), response_ids=np.arange(8, dtype=np.int32),
                      response_logprobs=np.zeros(8, np.float32), policy_version=1)


SHAPES: dict[str, Callable[[int], TurnRecord]] = {
    "one conversation, same answer (the overhead bench)": lambda i: _turn([SYSTEM, USER], "Paris."),
    "one prompt, a new sampled answer each call": lambda i: _turn([SYSTEM, USER], f"Paris {i}"),
    "a new conversation under one system prompt each call": lambda i: _turn(
        [SYSTEM, {"role": "user", "content": f"Summarise file {i}."}], f"Summary {i}"),
}


def measure(make: Callable[[int], TurnRecord], lengths: list[int], block: int) -> list[tuple[int, float, float]]:
    """(earlier turns, median µs per record_turn, comparisons per record_turn) at each length."""
    tree, n, out = TrajectoryTree(), 0, []
    compared = 0

    def counted(a: dict[str, Any], b: dict[str, Any]) -> bool:
        nonlocal compared
        compared += 1
        return messages_equal(a, b)

    for length in lengths:
        while n < length:
            tree.record_turn(make(n))
            n += 1
        turns = [make(n + k) for k in range(block)]
        times = []
        tree_mod.messages_equal = counted
        compared = 0
        try:
            for t in turns:
                t0 = time.perf_counter()
                tree.record_turn(t)
                times.append(time.perf_counter() - t0)
        finally:
            tree_mod.messages_equal = messages_equal
        n += block
        out.append((length, statistics.median(times) * 1e6, compared / block))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, nargs="+", default=[100, 1000, 3000])
    ap.add_argument("--block", type=int, default=100, help="turns timed at each length")
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.turns, args.block = [10, 200], 20
    record = Record("session_length", "record_turn against the session's length", quick=args.quick,
                    record_dir=args.record_dir)
    rows = []
    for name, make in SHAPES.items():
        for length, us, compared in measure(make, args.turns, args.block):
            rows.append([name, length, f"{us:.1f}", f"{compared:.1f}"])
            record.figure(f"{name} @ {length}", {"us": us, "comparisons": compared})
    record.table("one record_turn after N earlier turns of one session", ["shape", "N", "µs (median)",
                                                                           "messages compared"], rows)
    record.save()


if __name__ == "__main__":
    main()
