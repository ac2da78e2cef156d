"""What a run writes about its episodes, step by step, next to metrics.jsonl; tests, users and
``python -m rayrl.inspect`` read it.

``runs/<exp_id>/episodes/stepNNNNNN.jsonl``: one JSON line per episode the step took (failed ones
included), then one per episode of the groups set aside during the step (run again because
infrastructure failed too many of their episodes, or dropped as too stale), marked ``"discarded":
"rerun"`` or ``"stale"``: every episode that ran is written once. Each line holds the reward, status,
final answer and whatever else the harness put in ``Episode.info``, error and ``failure`` kind
(rayrl/rl/failures.py), sample count, generated tokens and timings; and, for the
inspector, the ``harness``, the GRPO ``advantage`` its samples trained with (None when it was not
trained), ``tokens`` (all its samples' lengths), ``prompt`` (the user message its first LLM call
answered, cut short) and ``detail`` (whether its token detail is kept).

``runs/<exp_id>/inspect/stepNNNNNN.json`` (``logging.inspect_episodes_per_step`` > 0): the step's
inspection data, one JSON document written whole (a reader never sees half of one)::

    {"format": 1, "step": N, "vocab": {"<id>": "<text of that token>", ...},
     "episodes": [{"index": i, "session_id": ..., "tree": <rayrl/trajectory/describe.py>,
                   "samples": [<sample detail>, ...] | null}, ...]}

Why bounded: every episode keeps its turn tree (structure; message texts cut to ``SHORT_TEXT_CHARS``),
but only the step's first ``inspect_episodes_per_step`` episodes (whole groups first: they come group by
group) keep token detail and the texts the gateway kept. A sample's detail is its ``tokens`` (prompt and
response), ``prompt_length``, the response-aligned ``mask`` and ``versions`` as runs (``[[value,
count], ...]``: both are long constant stretches), ``logprobs`` rounded to 4 decimals, its ``advantage``,
reward, status and the linearizer's metadata (``turns``: the LLM calls whose responses it holds,
``drift``, ``merged_turns``, ``leaf``). ``vocab`` maps each token id in the step's detail to its text, so a
reader needs no tokenizer. docs/inspector.md gives the sizes measured for the default run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from rayrl.rl.batch import Batch
from rayrl.rl.failures import is_scored
from rayrl.types import Episode, Sample

INSPECT_FORMAT = 1
SHORT_TEXT_CHARS = 240  # message text kept in the trees of episodes without token detail
LOGPROB_DECIMALS = 4

TokenText = Callable[[list[int]], list[str]]  # token ids -> the text of each one


def episode_advantages(episodes: Sequence[Episode], batch: Batch | None) -> list[float | None]:
    """The advantage each episode's samples trained with, in episode order (None: not in the batch).

    ``batch`` lists the scored episodes' samples in episode order (rayrl/rl/batch.py), one advantage per
    sample, the same for all samples of an episode; episodes of groups that were set aside
    (``info["discarded"]``) follow the step's own and were not in it."""
    out: list[float | None] = [None] * len(episodes)
    if batch is None:
        return out
    offset = 0
    for i, e in enumerate(episodes):
        if (not is_scored(e) or not e.samples or offset >= len(batch.samples)
                or batch.samples[offset] is not e.samples[0]):
            continue  # infrastructure failed, or not trained (set aside, or a group dynamic sampling dropped)
        out[i] = float(batch.advantages[offset])
        offset += len(e.samples)
    return out


def task_text(tree: dict[str, Any] | None, chars: int = SHORT_TEXT_CHARS) -> str:
    """The task as the agent put it, cut short: the last user message before the first LLM call's response
    (few-shot examples come before it, so the first user message is often not the task)."""
    nodes = (tree or {}).get("nodes", [])
    first = next((n for n in nodes if (n.get("gen") or {}).get("turn") == 0), None)
    current = nodes[first["parent"]] if first is not None and first["parent"] is not None else None
    while current is not None:
        if current.get("role") == "user":
            return str(current.get("text", ""))[:chars]
        current = nodes[current["parent"]] if current["parent"] is not None else None
    return ""


def episode_row(episode: Episode, advantage: float | None = None, harness: str = "", detail: bool = False) -> dict:
    """The JSON object written for one episode."""
    e = episode
    return {"session_id": e.session_id, "task_id": e.task_id, "group_id": e.group_id, "reward": e.reward,
            "status": e.status, "error": e.error, "failure": e.failure, "samples": len(e.samples),
            "generated_tokens": e.generated_tokens, **e.info, "harness": harness, "advantage": advantage,
            "tokens": int(sum(len(s.tokens) for s in e.samples)), "prompt": task_text(e.tree),
            "detail": detail, "timings": e.timings}


def write_episodes(run_dir: Path, step: int, episodes: Sequence[Episode], batch: Batch | None = None,
                   harness: str = "", detail_episodes: int = 0) -> Path:
    """Write the step's episodes file (replacing one left by an earlier attempt at this step)."""
    directory = Path(run_dir) / "episodes"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step{step:06d}.jsonl"
    advantages = episode_advantages(episodes, batch)
    with path.open("w") as fh:
        for i, e in enumerate(episodes):
            fh.write(json.dumps(episode_row(e, advantages[i], harness, i < detail_episodes)) + "\n")
    return path


def runs(values: np.ndarray) -> list[list[int]]:
    """Run-length form ``[[value, count], ...]`` of an integer array."""
    if len(values) == 0:
        return []
    values = np.asarray(values)
    starts = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
    counts = np.diff(np.concatenate([starts, [len(values)]]))
    return [[int(values[s]), int(n)] for s, n in zip(starts, counts)]


def sample_detail(sample: Sample, advantage: float | None) -> dict[str, Any]:
    """One sample's token detail (see module docstring)."""
    meta = sample.metadata
    return {
        "tokens": sample.tokens.tolist(),
        "prompt_length": int(sample.prompt_length),
        "mask": runs(sample.loss_mask),
        "versions": runs(sample.policy_versions),
        "logprobs": np.round(sample.rollout_logprobs.astype(np.float64), LOGPROB_DECIMALS).tolist(),
        "advantage": advantage,
        "reward": float(sample.reward),
        "status": sample.status,
        "turns": list(meta.get("turn_indices", [])),
        "trained_turns": meta.get("trained_turns"),
        "merged_turns": meta.get("merged_turns", 0),
        "drift": meta.get("drift"),
        "leaf": meta.get("leaf"),
    }


def shorten_tree(tree: dict[str, Any], text_chars: int = SHORT_TEXT_CHARS) -> dict[str, Any]:
    """A copy of a tree description with every message text (and tool-call argument) cut to ``text_chars``."""
    nodes = []
    for node in tree.get("nodes", []):
        short = {**node, "text": node.get("text", "")[:text_chars]}
        if node.get("tool_calls"):
            short["tool_calls"] = [{**c, "arguments": c.get("arguments", "")[:text_chars]} for c in node["tool_calls"]]
        nodes.append(short)
    return {**tree, "nodes": nodes}


def write_inspection(run_dir: Path, step: int, episodes: Sequence[Episode], batch: Batch | None,
                     detail_episodes: int, token_text: TokenText) -> Path:
    """Write ``inspect/stepNNNNNN.json`` for the step (atomically: a temporary file, then a rename)."""
    advantages = episode_advantages(episodes, batch)
    rows = []
    ids: set[int] = set()
    for i, e in enumerate(episodes):
        detail = i < detail_episodes
        tree = e.tree if e.tree is None or detail else shorten_tree(e.tree)
        samples = [sample_detail(s, advantages[i]) for s in e.samples] if detail else None
        for s in e.samples if detail else ():
            ids.update(np.unique(s.tokens).tolist())
        rows.append({"index": i, "session_id": e.session_id, "tree": tree, "samples": samples})
    ordered = sorted(ids)
    vocab = {str(t): text for t, text in zip(ordered, token_text(ordered))} if ordered else {}
    directory = Path(run_dir) / "inspect"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step{step:06d}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"format": INSPECT_FORMAT, "step": step, "vocab": vocab, "episodes": rows}))
    os.replace(tmp, path)
    return path


@lru_cache(maxsize=4)
def tokenizer_text(tokenizer_path: str) -> TokenText:
    """Token ids -> their texts with the tokenizer at ``tokenizer_path`` (loaded once per process).

    Each token is decoded alone, special tokens included, so a token that holds part of a multi-byte
    character shows as U+FFFD: the inspector draws what each token is, not what a run of them spells."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    def texts(ids: list[int]) -> list[str]:
        return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)

    return texts
