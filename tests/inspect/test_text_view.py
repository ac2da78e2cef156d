"""The inspector in a terminal (``--text``, rayrl/inspect/text.py): the run's steps and episodes, one episode's
turns and tool calls, and a token view whose tags are the sample's own mask, versions and LLM calls."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from rayrl.inspect.reader import RunReader
from rayrl.inspect.text import episode_view, run_view, sample_lines

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayrl.inspect", *args], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_token_view_tags_follow_mask_versions_and_calls():
    """A hand-made sample: 2 prompt tokens, then call #0 (trained, v3), a tool result (masked), call #1 (v4)."""
    vocab = {str(i): t for i, t in enumerate(["<s>", "Q?", "call", "(x)", "\n", "tool:", "5", "\n", "It", " is", " 5"])}
    sample = {"tokens": list(range(11)), "prompt_length": 2, "mask": [[1, 2], [0, 4], [1, 3]],
              "versions": [[3, 2], [3, 4], [4, 3]], "turns": [0, 1], "reward": 1.0, "advantage": 0.5,
              "status": "completed"}
    tree = {"nodes": [{"id": 0, "gen": {"turn": 0, "prompt_len": 2, "response_len": 2}},
                      {"id": 1, "gen": {"turn": 1, "prompt_len": 8, "response_len": 3}}]}
    assert sample_lines(0, sample, vocab, tree) == [
        "sample 0: LLM calls #0 #1  11 tokens (prompt 2, trained 5, masked 4)  reward 1  advantage 0.5000  completed",
        "  [prompt] <s>Q?",
        "  [train v3 #0] call(x)",
        "  [mask] \\ntool:5\\n",  # a newline inside a token is written as an escape: one terminal line per run
        "  [train v4 #1] It is 5",
    ]
    colored = sample_lines(0, sample, vocab, tree, color=True)
    assert colored[2] == "  [train v3 #0] \x1b[32mcall(x)\x1b[0m" and colored[3].startswith("  [mask] \x1b[2m")


def test_the_run_view_lists_steps_and_one_steps_episodes(scripted_run):
    run_dir, made = scripted_run
    text = run_view(RunReader(run_dir))
    lines = text.splitlines()
    assert lines[0].startswith(f"run {run_dir.name}")
    heading = next(i for i, line in enumerate(lines) if line.startswith("step  reward"))
    assert lines[heading + 1].split()[:2] == ["1", "0.667"]  # 2 of the 3 scored episodes of step 1 earned 1
    assert lines[heading + 2].split()[:2] == ["2", "0.500"]
    assert "episodes of step 2" in text and "2:2  failed: sandbox_failed" in text and "1:0" not in text
    first = run_view(RunReader(run_dir), step=1)
    assert "1:0  ok" in first and "task-tangle" in first and "2:0" not in first
    assert len(made["steps"][1]) == sum(1 for line in first.splitlines() if line.startswith("1:"))


def test_the_episode_view_shows_turns_tool_calls_and_tokens(scripted_run):
    run_dir, _ = scripted_run
    text = episode_view(RunReader(run_dir), 1, 0)
    assert "episode 1:0" in text and "task task-tangle" in text
    assert "-> tool call calculator(" in text and '"expression"' in text  # the call the model made
    assert "tool: 5" in text and "result of" in text  # and the tool's answer
    assert "drift: response @" in text and "fork-merge (trains nothing)" in text and "new top-level branch" in text
    assert re.search(r"\[LLM call #0: v\d+, prompt \d+ \+ response \d+ tokens, stop\]", text)
    tokens = [line for line in text.splitlines() if line.startswith("  [")]
    assert any(line.startswith("  [train v") for line in tokens) and tokens[0].startswith("  [prompt]")
    assert "\x1b[" not in text  # no colour unless asked
    plain = episode_view(RunReader(run_dir), 1, 2)  # kept no token detail: said so
    assert "token view: not kept for this episode" in plain


def test_the_command_line(scripted_run, tmp_path):
    run_dir, _ = scripted_run
    out = _cli(str(run_dir), "--text")
    assert out.returncode == 0 and "episodes of step 2" in out.stdout, out.stderr
    one = _cli(str(run_dir), "--text", "--episode", "1:0", "--color", "always")
    assert one.returncode == 0 and "\x1b[32m" in one.stdout and "-> tool call calculator(" in one.stdout, one.stderr
    for args, message in [(["--text", "--episode", "7:0"], "no episode 0 in step 7"),
                          (["--text", "--step", "9"], "no episodes for step 9; steps with episodes: 1, 2"),
                          (["--text", "--episode", "one"], "--episode: expected STEP:INDEX"),
                          (["--step", "1"], "give --text too")]:
        bad = _cli(str(run_dir), *args)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
