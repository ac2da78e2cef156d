"""Trajectory tree scaling: one agent session of 50, 100 and 200 turns at 5,000 new tokens per turn.

Measured side by side in one run, on identical data:

* ours: ``TrajectoryTree.record_turn`` per turn (first, last, median of the last 5, total),
  ``samples()`` (best of 3), peak and retained memory (tracemalloc, in a separate pass so tracing
  does not distort the timings);
* parsing: ``json.loads`` of each turn's request body (realistic OpenAI chat JSON with messages of
  the right size) — the cost a gateway pays anyway for every request;
* reference: the common approach, which keeps every turn whole (full prompt ids, response ids and
  log-probs as Python lists, plus the request's messages) and checks the token prefix with list
  slicing. It does no routing at all (generous to it). Its retained bytes are accounted from
  CPython object sizes (tracing 100M int objects would take minutes and gigabytes).

Each turn adds a tool result of 4,000 tokens (~16 KB text) and a response of 1,000 tokens (a tool
call whose arguments are ~3.6 KB plus 400 chars of text); turn 0's prompt is a 3,000-token system
prompt and a 1,000-token task. A 200-turn session ends at 1,000,000 tokens.

Targets: last turn's record_turn <= 0.5x parsing its request; retained <= 8 bytes per distinct token
+ 2x message text; samples() at 1M tokens < 50 ms.

    python bench/trajectory_scaling.py [--turns 50 100 200] [--no-reference]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from rayrl.trajectory import TrajectoryTree
from rayrl.types import TurnRecord

CHARS_PER_TOKEN = 4
BRIDGE_TOKENS = 4000
RESPONSE_TOKENS = 1000
TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object"}}}
    for n in ("bash", "edit")
]


@dataclass
class TurnData:
    body: str  # the request body as the gateway receives it
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    response_message: dict[str, Any]


class _Text:
    """Cheap distinct text: slices of a random pool at moving offsets (new str objects each time)."""

    def __init__(self, rng: np.random.Generator) -> None:
        letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     .,\n", dtype=np.uint8)
        self.pool = rng.choice(letters, size=1 << 21).tobytes().decode()
        self.pos = 0

    def take(self, n: int) -> str:
        if self.pos + n > len(self.pool):
            self.pos = 0
        self.pos += n + 7
        return self.pool[self.pos - n - 7 : self.pos - 7]


def session(turns: int, seed: int = 0) -> Iterator[TurnData]:
    """The session's turns, regenerated identically for each pass (client state lives here)."""
    rng = np.random.default_rng(seed)
    text = _Text(rng)
    encoded: list[str] = []  # each message JSON-encoded once, as a client would keep it

    def add(message: dict[str, Any]) -> None:
        encoded.append(json.dumps(message))

    add({"role": "system", "content": text.take(3000 * CHARS_PER_TOKEN)})
    add({"role": "user", "content": text.take(1000 * CHARS_PER_TOKEN)})
    seq = rng.integers(1000, 150_000, 4000, dtype=np.int32)
    for i in range(turns):
        messages = ", ".join(encoded)
        body = f'{{"model": "policy", "messages": [{messages}], "tools": {json.dumps(TOOLS)}}}'
        args = json.dumps({"cmd": text.take(3600 - 12)})
        message = {
            "role": "assistant",
            "content": text.take(400),
            "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": "bash", "arguments": args}}
            ],
        }
        response = rng.integers(1000, 150_000, RESPONSE_TOKENS, dtype=np.int32)
        logprobs = -rng.random(RESPONSE_TOKENS, dtype=np.float32)
        yield TurnData(body, seq, response, logprobs, message)
        add(message)
        tool_text = text.take(BRIDGE_TOKENS * CHARS_PER_TOKEN - 16)
        add({"role": "tool", "tool_call_id": f"call_{i}", "content": tool_text})
        seq = np.concatenate([seq, response, rng.integers(1000, 150_000, BRIDGE_TOKENS, dtype=np.int32)])


def _turn(data: TurnData, request: dict[str, Any]) -> TurnRecord:
    return TurnRecord(
        messages=request["messages"],
        response_message=data.response_message,
        prompt_ids=data.prompt_ids,
        response_ids=data.response_ids,
        response_logprobs=data.logprobs,
        tools=request["tools"],
    )


class ReferenceTree:
    """The common approach: every turn kept whole, token ids as Python lists, prefix checked by slicing."""

    def __init__(self) -> None:
        self.turns: list[dict[str, Any]] = []

    def record_turn(self, turn: TurnRecord) -> None:
        prompt = turn.prompt_ids.tolist()
        joins = False
        if self.turns:
            prev = self.turns[-1]
            prev_seq = prev["prompt"] + prev["response"]
            joins = prompt[: len(prev_seq)] == prev_seq
        self.turns.append(
            {
                "messages": turn.messages,
                "prompt": prompt,
                "response": turn.response_ids.tolist(),
                "logprobs": turn.response_logprobs.tolist(),
                "joins": joins,
            }
        )

    def samples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        last = self.turns[-1]
        start = len(self.turns[0]["prompt"])
        mask: list[int] = []
        logprobs: list[float] = []
        end = start
        for t in self.turns:
            bridge = len(t["prompt"]) - end
            mask += [0] * bridge + [1] * len(t["response"])
            logprobs += [0.0] * bridge + t["logprobs"]
            end = len(t["prompt"]) + len(t["response"])
        return np.array(last["prompt"] + last["response"], dtype=np.int32), np.array(mask), np.array(logprobs)

    def accounted_bytes(self) -> int:
        """CPython object sizes of what it keeps: lists, their int/float objects, messages' strings."""
        total = sys.getsizeof(self.turns)
        for t in self.turns:
            total += sys.getsizeof(t)
            for key in ("prompt", "response", "logprobs"):
                values = t[key]
                total += sys.getsizeof(values) + len(values) * (24 if key == "logprobs" else 28)
            total += sys.getsizeof(t["messages"])
            for m in t["messages"]:
                total += sys.getsizeof(m) + sum(sys.getsizeof(v) for v in m.values() if isinstance(v, str))
                for call in m.get("tool_calls") or []:
                    total += sys.getsizeof(call["function"]["arguments"])
        return total


def time_ours(turns: int) -> dict[str, Any]:
    tree = TrajectoryTree()
    record, parse = [], []
    for data in session(turns):
        t0 = time.perf_counter()
        request = json.loads(data.body)
        parse.append(time.perf_counter() - t0)
        turn = _turn(data, request)
        t0 = time.perf_counter()
        tree.record_turn(turn)
        record.append(time.perf_counter() - t0)
    timings = []
    for _ in range(3):
        t0 = time.perf_counter()
        samples = tree.samples(1.0)
        timings.append(time.perf_counter() - t0)
    assert len(samples) == 1 and samples[0].num_trained_tokens == turns * RESPONSE_TOKENS
    return {
        "record": record,
        "parse": parse,
        "samples_s": min(timings),
        "tokens": len(samples[0].tokens),
        "stats": tree.stats(),
    }


def memory_ours(turns: int) -> dict[str, int]:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tree = TrajectoryTree()
    distinct_text = 0
    gen = session(turns)
    for data in gen:
        request = json.loads(data.body)
        if not tree.stats()["turns"]:
            distinct_text += sum(len(json.dumps(m)) for m in request["messages"])
        else:
            distinct_text += sum(len(json.dumps(m)) for m in request["messages"][-1:])
        distinct_text += len(json.dumps(data.response_message))
        tree.record_turn(_turn(data, request))
        del request, data
    gen.close()
    del gen
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert tree.stats()["turns"] == turns  # the tree is alive (and measured) up to here
    return {"retained": current - base, "peak": peak - base, "text": distinct_text}


def reference(turns: int) -> dict[str, Any]:
    ref = ReferenceTree()
    record = []
    for data in session(turns):
        turn = _turn(data, json.loads(data.body))
        t0 = time.perf_counter()
        ref.record_turn(turn)
        record.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    ref.samples()
    samples_s = time.perf_counter() - t0
    out = {"record": record, "samples_s": samples_s, "retained": ref.accounted_bytes()}
    del ref
    gc.collect()
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:8.2f} ms"


def _mb(x: float) -> str:
    return f"{x / 2**20:9.1f} MB"


def _report(
    turns: int, t: dict[str, Any], m: dict[str, int], r: dict[str, Any] | None
) -> list[tuple[str, bool]]:
    tokens = t["tokens"]
    rec, parse = t["record"], t["parse"]
    rec5, parse5 = statistics.median(rec[-5:]), statistics.median(parse[-5:])
    budget = 8 * tokens + 2 * m["text"]
    print(f"\n=== {turns} turns x 5,000 tokens: {tokens:,} tokens, "
          f"{m['text'] / 2**20:.1f} MB distinct message JSON ===")
    print(f"record_turn   first {_ms(rec[0])}  last {_ms(rec[-1])}  median(last 5) {_ms(rec5)}  "
          f"total {_ms(sum(rec))}")
    print(f"json.loads    first {_ms(parse[0])}  last {_ms(parse[-1])}  median(last 5) {_ms(parse5)}  "
          f"total {_ms(sum(parse))}")
    print(f"record/parse  last turn {rec[-1] / parse[-1]:.3f}x   median(last 5) {rec5 / parse5:.3f}x   "
          f"total {sum(rec) / sum(parse):.3f}x")
    print(f"samples()     {_ms(t['samples_s'])}")
    print(f"memory        retained {_mb(m['retained'])} ({m['retained'] / tokens:.2f} B/token)  "
          f"peak {_mb(m['peak'])}  "
          f"budget {_mb(budget)} (8 B/token + 2x text): {m['retained'] / budget:.2f}x of budget")
    if r is not None:
        print(f"reference     record last {_ms(r['record'][-1])}  total {_ms(sum(r['record']))}  "
              f"samples() {_ms(r['samples_s'])}  retained {_mb(r['retained'])} (accounted)")
        print(f"ours/ref      record last {rec[-1] / r['record'][-1]:.3f}x  "
              f"total {sum(rec) / sum(r['record']):.3f}x  samples() {t['samples_s'] / r['samples_s']:.3f}x  "
              f"retained {m['retained'] / r['retained']:.4f}x")
    verdicts = [
        (f"{turns} turns: last record_turn <= 0.5x parse (median of last 5)", rec5 <= 0.5 * parse5),
        (f"{turns} turns: retained <= 8 B/token + 2x text", m["retained"] <= budget),
    ]
    if tokens >= 1_000_000:
        verdicts.append((f"{turns} turns: samples() < 50 ms at 1M tokens", t["samples_s"] < 0.050))
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, nargs="+", default=[50, 100, 200])
    parser.add_argument("--no-reference", action="store_true")
    args = parser.parse_args()
    verdicts: list[tuple[str, bool]] = []
    for turns in args.turns:
        t = time_ours(turns)
        m = memory_ours(turns)
        r = None if args.no_reference else reference(turns)
        verdicts += _report(turns, t, m, r)
    print("\n=== targets ===")
    for name, ok in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")


if __name__ == "__main__":
    main()
