"""``driver.py --dry-run`` (actors/dry_run.py): one episode of the first task against a real engine, in a real
local Ray, with the issue-43 agent: a program written with the Anthropic SDK 2.x that passes ``temperature``
as a keyword (TypeError in every episode), then the same program with the setting in ``extra_body``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayrl.config import load_config
from rayrl.types import Episode

ROOT = Path(__file__).resolve().parents[2]


def _cfg(model_dir: Path, tmp_path: Path, exp_id: str, command: str):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": 2 * i, "id": f"q{i}"}) + "\n"
                            for i in range(3)))
    return load_config(ROOT / "examples" / "unit_convert" / "config.yaml", [
        f"model.path={model_dir}", f"exp_id={exp_id}", f"logging.output_dir={tmp_path / 'runs'}",
        f"data.train_path={data}", "data.fields.prompt=question", "data.fields.answer=answer",
        "rollout.agent=command", f"rollout.agent_command=[python,{command}]", "rollout.reward=math",
        "rollout.episode_timeout_s=60", "engine.dtype=float32", "pipeline.eval_interval=0"])


@pytest.mark.slow  # ~1.5 min on a loaded 2-core machine: two real engines; fast twin below
def test_the_dry_run_says_what_fails_before_the_run_and_passes_once_fixed(ray_local, tiny_model_dir, tmp_path,
                                                                          capsys):
    from actors.dry_run import dry_run

    broken = _cfg(tiny_model_dir, tmp_path, "dry-broken", "tests/anthropic_agent.py,--as-keyword")
    assert dry_run(broken) is False
    out = capsys.readouterr().out
    assert "dry run: task q0 against the engine at http://" in out
    assert "session " in out and "task q0" in out and "status failed: agent_crashed" in out
    assert out.count("Traceback (most recent call last)") == 1 and "unexpected keyword argument 'temperature'" in out
    assert "task q0: asking" in out  # what the program said before it crashed: the error is its stderr's end
    assert "stderr (its end):" not in out  # ... so it is not printed twice
    last = out.strip().splitlines()[-1]
    assert last.startswith("[rayrl] dry run FAILED (agent_crashed): TypeError: ") and "'temperature'" in last
    assert "0 LLM call(s)" in last  # the SDK refused before any request

    fixed = _cfg(tiny_model_dir, tmp_path, "dry-fixed", "tests/anthropic_agent.py")
    assert dry_run(fixed) is True
    out = capsys.readouterr().out
    assert "status ok" in out and "turns:" in out and "  user: What is 0 + 0?" in out
    assert "stderr (its end):\n  task q0: asking" in out  # a success's stderr is shown too
    assert "[train v0" in out  # the token view of what this episode would train
    assert out.strip().splitlines()[-1].startswith("[rayrl] dry run ok: reward 0, 1 LLM call(s), 0 tool call(s)")


def test_the_outcome_names_the_failure_once_and_says_how_to_go_on(tiny_model_dir, tmp_path):
    """The fast twin: what the dry run prints of an episode (actors/dry_run.py ``outcome``), without Ray."""
    from actors.dry_run import outcome

    cfg = _cfg(tiny_model_dir, tmp_path, "dry-outcome", "tests/anthropic_agent.py")
    error = ("agent_crashed: exited with 1: task q0: asking\nTraceback (most recent call last):\n  File \"a.py\", "
             "line 3\nTypeError: create() got an unexpected keyword argument 'temperature'")
    crashed = Episode("s0-1", "q0", "dry-run", reward=0.0, status="failed", failure="agent_crashed", error=error,
                      info={"turns": 0, "tool_calls": 0, "stderr": error.split("exited with 1: ")[1]})
    text = outcome(cfg, crashed, 2.5)
    assert text.count("Traceback (most recent call last)") == 1 and "stderr (its end)" not in text
    assert text.splitlines()[-1] == ("[rayrl] dry run FAILED (agent_crashed): TypeError: create() got an unexpected "
                                     "keyword argument 'temperature' (reward 0, 0 LLM call(s), 0 tool call(s), 2.5 s); "
                                     "every episode of the run would likely fail the same way")
    ok = Episode("s0-2", "q0", "dry-run", reward=1.0, info={"turns": 2, "tool_calls": 1, "stderr": "warning: x"})
    text = outcome(cfg, ok, 1.0)
    assert "stderr (its end):\n  warning: x" in text and "token view: not kept" not in text
    assert text.splitlines()[-1] == ("[rayrl] dry run ok: reward 1, 2 LLM call(s), 1 tool call(s), 1.0 s; the full "
                                     "run is the same command without --dry-run")
