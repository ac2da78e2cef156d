"""Trajectory tree scaling: one agent session of 50, 100 and 200 turns at 5,000 new tokens per turn.

Each turn adds a tool result of 4,000 tokens (~16 KB text) and a response of 1,000 tokens (a tool
call whose arguments are ~3.6 KB plus 400 chars of text); turn 0's prompt is a 3,000-token system
prompt and a 1,000-token task. A 200-turn session ends at 1,000,000 tokens. Every request body is
realistic OpenAI chat JSON with messages of the right size.

The headline is the floor every implementation pays: ``json.loads`` of the same request body, timed
on the same turn. Ours (``TrajectoryTree.record_turn`` per turn, ``samples()``) is reported against
it. Peer figures recorded elsewhere are printed beside ours, labelled cross-run.

Same run, alternating pass by pass with ours (bench/measure.py): a model of slime's turn-node
TrajectoryManager, written here from its description (slime PR #2005, ../seeds 004) and its source
(THUDM/slime ``slime/agent/trajectory.py`` at 121bfdd; no code copied). Per turn, ``record_turn`` walks the
session's message tree from the root, matching each request message against the children by role
and ``dict ==`` (the first match goes deeper), mounts the unmatched messages as routing-only nodes
and attaches the response message as a generated leaf holding the turn's ``prompt_ids``,
``output_ids`` and log-probs as the Python lists the adapter built from SGLang's JSON (handing it
lists costs it nothing, so the lists are made before its timer starts). No token is compared while
recording. ``get_trajectory`` walks each root-to-leaf path and extends one token list per sample:
the held tokens must be a prefix of the next turn's prompt (compared in 4,096-token list slices,
as slime's ``_common_prefix_len`` does), the prompt tail is appended with mask 0 and the response
with mask 1. Its retained bytes are accounted from CPython object sizes (8 B per list slot plus a
28 B int / 24 B float object per id / log-prob, as per-turn lists from JSON hold them; the model
itself shares the int objects between turns to keep this bench's memory down).

Targets: last turn's record_turn <= 0.5x parsing its request; retained <= 8 bytes per distinct token
+ 2x message text; samples() at 1M tokens < 50 ms.

    python bench/trajectory_scaling.py [--turns 50 100 200] [--no-peer-model] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from measure import Record, add_common_args, alternate, paired_ratio

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


# -------------------------------------------------------------------- a model of slime's TrajectoryManager


class _Node:
    __slots__ = ("role", "message", "children", "turn")

    def __init__(self, message: dict[str, Any] | None) -> None:
        self.role = message.get("role") if message else None
        self.message = message
        self.children: list[_Node] = []
        self.turn: tuple[list[int], list[int], list[float]] | None = None  # prompt, output, log-probs


class SlimeModel:
    """slime's routing by message equality and its linearization, as described in the module docstring."""

    def __init__(self) -> None:
        self.root = _Node(None)

    def record_turn(self, messages: list[dict[str, Any]], response: dict[str, Any],
                    prompt: list[int], output: list[int], logprobs: list[float]) -> None:
        node, depth = self.root, 0
        while depth < len(messages):  # deepest node whose path equals the request's first messages
            msg = messages[depth]
            nxt = next((c for c in node.children if c.role == msg.get("role") and c.message == msg), None)
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        for msg in messages[depth:]:  # the rest: routing-only nodes
            child = _Node(msg)
            node.children.append(child)
            node = child
        leaf = _Node(response)
        leaf.turn = (prompt, output, logprobs)
        node.children.append(leaf)

    def samples(self) -> list[tuple[list[int], list[int], list[float]]]:
        out = []
        stack = [(self.root, [])]
        while stack:  # one sample per root-to-leaf path (a single path here)
            node, path = stack.pop()
            path = path + [node]
            if not node.children:
                out.append(self._linearize([n.turn for n in path if n.turn is not None]))
            stack.extend((c, path) for c in node.children)
        return out

    @staticmethod
    def _linearize(turns: list[tuple[list[int], list[int], list[float]]]) -> tuple[list[int], list[int], list[float]]:
        tokens: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        for prompt, output, lps in turns:
            held = _common_prefix_len(tokens, prompt)
            if held != len(tokens):
                raise AssertionError("the bench's session has no drift")
            tail = prompt[held:]
            tokens.extend(tail)
            mask.extend([0] * len(tail))
            logprobs.extend([0.0] * len(tail))
            tokens.extend(output)
            mask.extend([1] * len(output))
            logprobs.extend(lps)
        start = len(turns[0][0])  # the sample: a copy of the tokens; mask and log-probs from the first response
        return list(tokens), mask[start:], logprobs[start:]


def _common_prefix_len(a: list[int], b: list[int], chunk: int = 4096) -> int:
    """Length of the common prefix, compared a slice of ``chunk`` ids at a time."""
    limit, done = min(len(a), len(b)), 0
    while done < limit:
        end = min(done + chunk, limit)
        if a[done:end] != b[done:end]:
            while a[done] == b[done]:
                done += 1
            return done
        done = end
    return done


def _accounted_bytes(lengths: list[tuple[int, int]], text: int) -> int:
    """What per-turn lists from JSON hold: per id 8 B slot + 28 B int, per log-prob 8 B + 24 B float;
    plus the message text (one copy per node)."""
    return sum(36 * (p + o) + 32 * o for p, o in lengths) + text


# -------------------------------------------------------------------- passes


def pass_ours(turns: int) -> dict[str, Any]:
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
    t0 = time.perf_counter()
    samples = tree.samples(1.0)
    samples_s = time.perf_counter() - t0
    assert len(samples) == 1 and samples[0].num_trained_tokens == turns * RESPONSE_TOKENS
    return {"record": record, "parse": parse, "samples_s": samples_s, "tokens": len(samples[0].tokens)}


def pass_peer_model(turns: int) -> dict[str, Any]:
    model = SlimeModel()
    record, parse, lengths = [], [], []
    held: list[int] = []  # the token ids so far, as one list whose int objects the turns share
    text = 0
    for data in session(turns):
        t0 = time.perf_counter()
        request = json.loads(data.body)
        parse.append(time.perf_counter() - t0)
        held.extend(data.prompt_ids[len(held):].tolist())
        prompt, output, logprobs = held[:], data.response_ids.tolist(), data.logprobs.tolist()
        messages = request["messages"]
        text += (sum(len(json.dumps(m)) for m in messages[-1 if lengths else 0:])
                 + len(json.dumps(data.response_message)))
        t0 = time.perf_counter()
        model.record_turn(messages, data.response_message, prompt, output, logprobs)
        record.append(time.perf_counter() - t0)
        lengths.append((len(prompt), len(output)))
        held.extend(output)
    t0 = time.perf_counter()
    (tokens, mask, _), = model.samples()
    samples_s = time.perf_counter() - t0
    assert sum(mask) == turns * RESPONSE_TOKENS and len(tokens) == turns * (RESPONSE_TOKENS + BRIDGE_TOKENS)
    return {"record": record, "parse": parse, "samples_s": samples_s, "tokens": len(tokens),
            "retained": _accounted_bytes(lengths, text)}


def _figures(p: dict[str, Any]) -> dict[str, float]:
    rec, parse = p["record"], p["parse"]
    return {"record_last5": statistics.median(rec[-5:]), "parse_last5": statistics.median(parse[-5:]),
            "record_total": sum(rec), "parse_total": sum(parse), "samples": p["samples_s"],
            "record_last": rec[-1]}


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


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, nargs="+", default=[50, 100, 200])
    ap.add_argument("--no-peer-model", action="store_true", help="ours and json.loads only")
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.turns = [10, 20]
    rounds = dict(min_rounds=2, max_rounds=2, warmup=0) if args.quick else dict(min_rounds=5, max_rounds=7,
                                                                                  warmup=0, budget_s=60)
    record = Record("trajectory_scaling", "Trajectory tree scaling (one session up to 1M tokens)",
                    quick=args.quick, record_dir=args.record_dir)
    rows, peer_rows, mem_rows, verdicts = [], [], [], []
    for turns in args.turns:
        sides = {"ours": lambda t=turns: _figures(pass_ours(t))}
        if not args.no_peer_model:
            retained = {}

            def peer(t: int = turns, retained: dict = retained) -> dict[str, float]:
                p = pass_peer_model(t)
                retained[t] = p["retained"]
                return _figures(p)
            sides["slime model"] = peer
        res = alternate(sides, label=f"{turns} turns", **rounds)
        m = memory_ours(turns)
        # the last sample: 4,000 prompt + 5,000 per turn - the last bridge
        tokens = turns * (RESPONSE_TOKENS + BRIDGE_TOKENS)
        ours = res["ours"]
        over_parse = paired_ratio(ours["record_last5"], ours["parse_last5"])
        ms = lambda sp: sp.scaled(lambda x: x * 1e3).fmt(2)  # noqa: E731
        rows.append([turns, f"{tokens:,}", ms(ours["parse_last5"]), ms(ours["record_last5"]), over_parse.fmt(3, "x"),
                     ms(ours["record_total"]), ms(ours["samples"])])
        budget = 8 * tokens + 2 * m["text"]
        mem_rows.append([turns, f"{m['retained'] / 2**20:.1f} MiB", f"{m['retained'] / tokens:.2f}",
                         f"{m['peak'] / 2**20:.1f} MiB", f"{budget / 2**20:.1f} MiB", f"{m['retained'] / budget:.2f}x"])
        verdicts += [(f"{turns} turns: record_turn <= 0.5x parse (median of the last 5 turns)",
                      over_parse.median <= 0.5),
                     (f"{turns} turns: retained <= 8 B/token + 2x text", m["retained"] <= budget)]
        if tokens >= 1_000_000:
            verdicts.append((f"{turns} turns: samples() < 50 ms at 1M tokens", ours["samples"].median < 0.050))
        record.figure(f"record_over_parse_{turns}", over_parse)
        if "slime model" in res:
            peer_f = res["slime model"]
            peer_rows.append([turns, ms(peer_f["record_last5"]), paired_ratio(peer_f["record_last5"],
                              peer_f["parse_last5"]).fmt(3, "x"), ms(peer_f["record_total"]), ms(peer_f["samples"]),
                              f"{retained[turns] / 2**20:.0f} MiB",
                              paired_ratio(ours["record_last5"], peer_f["record_last5"]).fmt(3, "x")])
    record.table("ours against json.loads of the same request body (the floor every gateway pays); ms, median "
                 "[IQR] (min-max, n) over passes; last 5 = median of the session's last 5 turns",
                 ["turns", "tokens", "json.loads last 5", "record_turn last 5", "record/parse",
                  "record_turn total", "samples()"], rows)
    record.table("memory (tracemalloc, one pass): retained after the session, peak while recording",
                 ["turns", "retained", "B/token", "peak", "budget (8 B/token + 2x text)", "of budget"], mem_rows)
    if peer_rows:
        record.table("same run, alternating with ours: the model of slime's TrajectoryManager described in the "
                     "module docstring (not slime's code); ms",
                     ["turns", "record_turn last 5", "record/parse", "record_turn total", "get_trajectory",
                      "retained (accounted)", "ours/model record last 5"], peer_rows)
    record.note("cross-run peer figures (other runs, other code; not measured here): slime PR #2005 reports 17.6 ms "
                "for routing 200 nodes x 5K tokens (1M context) with dict == (1,198 ms with json.dumps keys) "
                "(../seeds 004); issue 21 records ~2 ms for the 200th turn of slime's own trajectory manager on "
                "this machine type.")
    record.note("targets: " + "; ".join(f"{name}: {'PASS' if ok else 'FAIL'}" for name, ok in verdicts))
    record.save()


if __name__ == "__main__":
    main()
