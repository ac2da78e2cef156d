"""An ATIF document checked as Harbor reads it: the vendored schema, then the rules Harbor's models add
(tests/inspect/test_atif.py and the whole-pipeline inspection test)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from rayrl.inspect.atif import ATIF_VERSION

SCHEMA = json.loads((Path(__file__).parent / "data" / "atif-v1.8.schema.json").read_text())
AGENT_ONLY = ("model_name", "reasoning_effort", "reasoning_content", "tool_calls", "metrics")


def check_trajectory(doc: dict) -> None:
    """The schema, then the rules Harbor's models add (trajectory.py / step.py validators)."""
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    assert doc["schema_version"] == ATIF_VERSION
    assert [s["step_id"] for s in doc["steps"]] == list(range(1, len(doc["steps"]) + 1))
    for step in doc["steps"]:
        if step["source"] != "agent":
            assert not any(k in step for k in AGENT_ONLY), step
        ids = {c["tool_call_id"] for c in step.get("tool_calls", [])}
        for result in (step.get("observation") or {}).get("results", []):
            assert result.get("source_call_id") is None or result["source_call_id"] in ids
    subs = doc.get("subagent_trajectories") or []
    assert len({s["trajectory_id"] for s in subs}) == len(subs) and all(s["trajectory_id"] for s in subs)
    for sub in subs:
        check_trajectory(sub)
