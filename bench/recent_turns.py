"""What a session's remembered turns cost the garbage collector: kept as sent, or sharing their messages.

    python bench/recent_turns.py [--sessions 2000] [--turns 8] [--quick]

A gateway session remembers its newest turns (``Session.recent``, at most 8) as cumulative token mode's
candidates. Every request of a tool-calling agent sends its whole history again, decoded into fresh dicts,
so remembered as sent, an n-turn session held 1 + 2 + ... + n copies of its messages (each tool call a
few nested dicts more): objects every full collection walks with the event loop stopped. Remembered
turns now share the previous turn's dicts (``Session.remember(turn, prev)``).

Both sides run the gateway's own steps in-process, in alternation (bench/measure.py): for each of
``--sessions`` sessions, ``--turns`` requests whose history is decoded fresh from JSON, matched with
``Session.history_match`` and remembered, with ``prev`` (shared) or without it (as sent: the code before
the change). Reported: the objects the collector tracks per session (what the sessions added to
``gc.get_objects()``), and the time of one full ``gc.collect()`` with every session held.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any, Callable

import numpy as np
from measure import Record, add_common_args, alternate

from rayrl.gateway.sessions import Session
from rayrl.types import TurnRecord

SYSTEM = {"role": "system", "content": "You are a software engineering agent. Use the tools."}
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                           "parameters": {"type": "object", "properties": {
                                               "command": {"type": "string"}}, "required": ["command"]}}}]


def one_session(i: int, turns: int, shared: bool) -> Session:
    """A session of ``turns`` tool calls, remembered as the gateway does (the tree left out: both sides
    mount the same dicts in it)."""
    session = Session(session_id=f"s{i}", token="", metadata={}, tree=None)  # type: ignore[arg-type]
    history: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"Task {i}: find the handler."}]
    ids = np.arange(40, dtype=np.int32)
    for t in range(turns):
        messages = json.loads(json.dumps(history))  # the request's body, decoded: fresh dicts
        tools = json.loads(json.dumps(TOOLS))
        prev = session.history_match(messages)
        call = {"id": f"call_{i}_{t}", "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"command": f"grep -rn handler s{i} t{t}"})}}
        response = {"role": "assistant", "content": "", "tool_calls": [call]}
        turn = TurnRecord(messages=messages, response_message=response, prompt_ids=ids, response_ids=ids[:8],
                          response_logprobs=np.zeros(8, np.float32), tools=tools)
        session.remember(turn, prev if shared else None)
        history = [*history, json.loads(json.dumps(response)),
                   {"role": "tool", "tool_call_id": call["id"], "content": "src/app.py:12: def handler():"}]
    return session


def side(sessions: int, turns: int, shared: bool) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        gc.collect()
        before = len(gc.get_objects())
        held = [one_session(i, turns, shared) for i in range(sessions)]
        tracked = len(gc.get_objects()) - before
        started = time.perf_counter()
        gc.collect()
        collect_ms = (time.perf_counter() - started) * 1e3
        assert len(held) == sessions
        del held
        return {"tracked_per_session": tracked / sessions, "full_collection_ms": collect_ms}

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=8, help="tool calls per session (8: every turn is remembered)")
    add_common_args(ap)
    args = ap.parse_args()
    sessions = 200 if args.quick else args.sessions
    rec = Record("recent_turns", "A session's remembered turns: kept as sent, or sharing their messages",
                 quick=args.quick, record_dir=args.record_dir)
    result = alternate({"as sent (before)": side(sessions, args.turns, False),
                        "shared (now)": side(sessions, args.turns, True)},
                       min_rounds=3 if args.quick else 5, max_rounds=5 if args.quick else 9, label="recent")
    rec.figure("result", result)
    rec.table(f"{sessions} sessions of {args.turns} tool calls each, in one process; median [IQR] (min-max, n)",
              ["remembered", "GC-tracked objects per session", "one full gc.collect() ms"],
              [[name, figs["tracked_per_session"].fmt(0), figs["full_collection_ms"].fmt(1)]
               for name, figs in result.items()])
    rec.save()


if __name__ == "__main__":
    main()
