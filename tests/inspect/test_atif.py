"""ATIF export (rayrl/inspect/atif.py), validated against the published schema (vendored: see the
schema file's $comment) and the cross-field rules of Harbor's models that a JSON schema cannot state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from rayrl.inspect.atif import ATIF_VERSION
from tests.inspect.atif_check import SCHEMA, check_trajectory

ROOT = Path(__file__).resolve().parents[2]
def _export(run_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayrl.inspect", str(run_dir), "--atif", str(out), *extra],
                          check=False,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_atif_export_validates_and_keeps_tokens_tree_and_rewards(scripted_run, tmp_path):
    run_dir, made = scripted_run
    out = _export(run_dir, tmp_path / "run.atif.json")
    assert out.returncode == 0, out.stderr
    docs = json.loads((tmp_path / "run.atif.json").read_text())
    assert len(docs) == 5 and "5 ATIF trajectories (2 episodes without a recorded tree skipped)" in out.stdout
    for doc in docs:
        check_trajectory(doc)
    tangle = made["steps"][1][0]
    doc = next(d for d in docs if d["session_id"] == tangle.session_id)
    assert doc["agent"]["name"] == "scripted_agent" and doc["extra"]["rayrl"]["reward"] == 1.0
    steps = doc["steps"]
    assert [s["source"] for s in steps] == ["system", "user", "agent", "agent", "user", "agent"]
    call = steps[2]
    assert call["tool_calls"][0]["function_name"] == "calculator"
    assert call["tool_calls"][0]["arguments"] == {"expression": "2+3"}
    result = call["observation"]["results"][0]
    assert result == {"source_call_id": call["tool_calls"][0]["tool_call_id"], "content": "5"}
    sample = tangle.samples[0]  # call 0 trains in the first sample: its exact tokens and log-probs
    p = sample.prompt_length
    assert call["metrics"]["prompt_token_ids"] == sample.tokens[:p].tolist()
    assert call["metrics"]["completion_token_ids"] == sample.tokens[p:].tolist()
    assert call["metrics"]["logprobs"] == pytest.approx(sample.rollout_logprobs.tolist(), abs=1e-4)
    merged, last = steps[3]["extra"]["rayrl"], steps[5]["extra"]["rayrl"]
    assert merged["fork_merge"] and "completion_token_ids" not in steps[3]["metrics"]  # it trains nothing
    assert last["drift"]["kind"] == "response" and last["llm_call"] == 2
    (sub,) = doc["subagent_trajectories"]  # the sub-agent's branch
    assert [s["source"] for s in sub["steps"]] == ["system", "user", "agent"]
    assert sub["steps"][2]["extra"]["rayrl"]["llm_call"] == 3


def test_atif_one_session_is_one_trajectory_and_unknown_is_a_clear_error(scripted_run, tmp_path):
    run_dir, made = scripted_run
    plain = made["steps"][2][1]
    out = _export(run_dir, tmp_path / "one.json", "--session", plain.session_id)
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "one.json").read_text())
    check_trajectory(doc)
    assert doc["session_id"] == plain.session_id and "subagent_trajectories" not in doc
    assert [s["source"] for s in doc["steps"]] == ["system", "user", "agent", "user", "agent"]
    out = _export(run_dir, tmp_path / "none.json", "--session", "s0-nope")
    assert out.returncode == 2 and "s0-nope" in out.stderr and "Traceback" not in out.stderr


def test_the_vendored_schema_rejects_what_atif_forbids():
    """The schema file is the real one, not a permissive stand-in: it refuses a step without source."""
    bad = {"schema_version": ATIF_VERSION, "agent": {"name": "a", "version": "1"},
           "steps": [{"step_id": 1, "message": "m"}]}
    with pytest.raises(jsonschema.ValidationError, match="source"):
        jsonschema.Draft202012Validator(SCHEMA).validate(bad)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMA).validate({**bad, "steps": []})
