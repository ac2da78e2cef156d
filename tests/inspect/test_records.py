"""The run records the inspector reads (rayrl/records.py): summary rows, bounded inspection data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rayrl.config import ConfigError, load_config
from rayrl.records import SHORT_TEXT_CHARS, episode_advantages, runs, shorten_tree
from rayrl.rl.batch import build_batch

ROOT = Path(__file__).resolve().parents[2]


def _expand(pairs):
    return [v for v, n in pairs for _ in range(n)]


def test_records_keep_rows_for_all_trees_for_all_tokens_for_the_first_n(scripted_run):
    run_dir, made = scripted_run
    episodes = made["steps"][1]
    rows = [json.loads(line) for line in (run_dir / "episodes" / "step000001.jsonl").read_text().splitlines()]
    assert [r["session_id"] for r in rows] == [e.session_id for e in episodes]
    assert {r["harness"] for r in rows} == {"scripted_agent"}
    assert [r["detail"] for r in rows] == [True, True, False, False]  # DETAIL_EPISODES = 2
    assert rows[0]["prompt"] == "What is 2 + 3? Use the calculator."
    assert rows[3]["status"] == "failed" and rows[3]["advantage"] is None and rows[3]["tokens"] == 0
    assert rows[3]["failure"] == "sandbox_failed" and rows[0]["failure"] is None
    # the advantage each episode's samples train with, as the batch gives it
    batch = build_batch(episodes)
    assert [r["advantage"] for r in rows] == episode_advantages(episodes, batch)
    assert rows[1]["advantage"] == batch.advantages[len(episodes[0].samples)] < 0 < rows[2]["advantage"]

    doc = json.loads((run_dir / "inspect" / "step000001.json").read_text())
    assert doc["format"] == 1 and doc["step"] == 1 and not list((run_dir / "inspect").glob("*.tmp"))
    entries = doc["episodes"]
    assert [e["index"] for e in entries] == [0, 1, 2, 3]
    assert entries[3]["samples"] is None and entries[3]["tree"] is None  # failed before any session
    assert entries[2]["samples"] is None and entries[2]["tree"] == shorten_tree(episodes[2].tree)
    for entry, episode in zip(entries[:2], episodes):
        assert entry["tree"] == episode.tree  # detail episodes keep the tree as the gateway described it
        assert len(entry["samples"]) == len(episode.samples)
        for d, s in zip(entry["samples"], episode.samples):
            assert d["tokens"] == s.tokens.tolist() and d["prompt_length"] == s.prompt_length
            assert _expand(d["mask"]) == s.loss_mask.tolist()
            assert _expand(d["versions"]) == s.policy_versions.tolist()
            assert np.allclose(d["logprobs"], s.rollout_logprobs, atol=1e-4)
            assert d["turns"] == s.metadata["turn_indices"] and d["drift"] == s.metadata["drift"]
            assert all(str(t) in doc["vocab"] for t in d["tokens"])
    plain = entries[1]["samples"][0]
    assert 0 in _expand(plain["mask"]) and 1 in _expand(plain["mask"])  # a bridge between two joined turns
    assert "".join(doc["vocab"][str(t)] for t in plain["tokens"]).startswith("<|im_start|>system\n")


def test_episodes_without_detail_keep_a_short_tree(scripted_run):
    run_dir, _ = scripted_run
    long_text = "x" * (SHORT_TEXT_CHARS * 3)
    tree = {"version": 1, "stats": {}, "nodes": [
        {"id": 0, "parent": None, "role": "user", "text": long_text, "chars": len(long_text)},
        {"id": 1, "parent": 0, "role": "assistant", "text": "ok", "chars": 2,
         "tool_calls": [{"id": "c", "name": "f", "arguments": long_text}]}]}
    short = shorten_tree(tree)
    assert len(short["nodes"][0]["text"]) == SHORT_TEXT_CHARS and short["nodes"][0]["chars"] == len(long_text)
    assert len(short["nodes"][1]["tool_calls"][0]["arguments"]) == SHORT_TEXT_CHARS
    assert tree["nodes"][0]["text"] == long_text  # a copy: the episode's own tree is left alone
    doc = json.loads((run_dir / "inspect" / "step000002.json").read_text())
    assert [e["samples"] is None for e in doc["episodes"]] == [False, False, True]


def test_runs_round_trip():
    for values in ([], [1], [0, 0, 1, 1, 1, 0], [3, 3, 3, 4, 3]):
        assert _expand(runs(np.asarray(values, dtype=np.int32))) == values
    assert runs(np.asarray([0, 0, 1])) == [[0, 2], [1, 1]]


def test_inspect_episodes_per_step_is_checked_at_load():
    with pytest.raises(ConfigError, match=r"^logging\.inspect_episodes_per_step"):
        load_config(ROOT / "examples" / "calculator" / "config.yaml", ["logging.inspect_episodes_per_step=-1"])
    assert load_config(ROOT / "examples" / "calculator" / "config.yaml").logging.inspect_episodes_per_step == 4
