"""driver.py's command line: bad configs, missing models, your own agent and reward named wrong, bad data rows:
each fails before Ray starts with one line that names the field, and exit code 2.

Two cases run driver.py as the real command (a subprocess: exit status, stderr, nothing imported beforehand);
the rest call its ``main`` in this process, the same code path without paying for a new interpreter each time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_driver(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "driver.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, **(env or {})})


def run_main(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """driver.main in this process, its result shaped as run_driver's."""
    import driver

    capsys.readouterr()
    code = driver.main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["driver.py", *args], code, captured.out, captured.err)


def assert_one_line_exit_2(out: subprocess.CompletedProcess, message: str) -> None:
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "Started a local Ray" not in out.stderr + out.stdout and "[rayrl]" not in out.stdout  # before Ray


@pytest.mark.parametrize(
    "args, message",
    [
        (["trainer.stepz=3"], "config error: trainer.stepz"),
        (["rollout.temperature=warm"], "config error: rollout.temperature"),
        (["--config", "/nope.yaml"], "config error: config file not found"),
        (["model.path=/no/such/model"], "model error: model.path: '/no/such/model' is not a model directory"),
        (["trainer.loss=grpo"], "config error: trainer.loss: removed; it selected nothing; write "
                                "algorithm.advantage_estimator"),
        (["algorithm.policy_loss=gspo_typo"], "config error: algorithm.policy_loss: unknown 'gspo_typo'"),
        (["algorithm.kl_loss_coef=0.1", "algorithm.reference_path=/no/ref"],
         "model error: algorithm.reference_path: '/no/ref' is not a model directory"),
        (["algorithm.distill_teacher=/no/teacher"],
         "model error: algorithm.distill_teacher: '/no/teacher' is not a model directory"),
        (["rollout.reward=judge", "rollout.judge.serve=/no/judge"],
         "model error: rollout.judge.serve: '/no/judge' is not a model directory"),
    ],
)
def test_bad_input_exits_2_with_message(args, message, capsys):
    out = run_main(capsys, *args)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr[-2000:]
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()  # failed before starting Ray


def test_the_command_itself_exits_2_with_one_line():
    assert_one_line_exit_2(run_driver("trainer.stepz=3"), "config error: trainer.stepz")


UNIT = "--config=examples/unit_convert/config.yaml"


@pytest.mark.parametrize(
    "args, message",
    [
        ([UNIT, "rollout.agent=examples.unit_convert.agent:solv"],
         "config error: rollout.agent: module 'examples.unit_convert.agent' has no 'solv' (did you mean 'solve'?)"),
        ([UNIT, "rollout.reward=tests.byo_agents:reward_takes_one_argument"],
         "config error: rollout.reward: tests.byo_agents:reward_takes_one_argument(result) cannot be called as "
         "reward(task, result)"),
    ],
)
def test_your_own_agent_and_reward_are_checked_at_load(args, message, capsys):
    """Every other mistake tests/test_preflight.py checks on its own; these two go through driver.main."""
    assert_one_line_exit_2(run_main(capsys, *args), message)


def test_a_module_that_fails_to_import_names_the_field_and_the_line(tmp_path):
    (tmp_path / "broken_agent.py").write_text("import os\n\nTOOLS = [undefined_name]\n\n"
                                              "async def solve(task, endpoint):\n    return ''\n")
    out = run_driver(UNIT, "rollout.agent=broken_agent:solve", env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    assert_one_line_exit_2(out, "config error: rollout.agent: importing 'broken_agent' failed: NameError: name "
                                f"'undefined_name' is not defined ({tmp_path / 'broken_agent.py'}:3)")


def test_bad_data_rows_are_named_with_file_and_line(tmp_path, capsys):
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"prompt": "ok", "metadata": {"answer": 1}}\n{"question": "no prompt"}\n\n{broken\n'
                    '{"prompt": "p", "metadata": "not an object"}\n')
    out = run_main(capsys, UNIT, f"data.train_path={data}")
    assert_one_line_exit_2(out, f"config error: data.train_path: {data}:2: no field 'prompt' (data.fields.prompt); "
                                f"the row has: question; {data}:4: invalid JSON")
    assert f"{data}:5: 'metadata' must be an object" in out.stderr
    missing = run_main(capsys, UNIT, "data.val_path=examples/unit_convert/data/vall.jsonl")
    assert_one_line_exit_2(missing, "config error: data.val_path: data file not found: "
                                    f"examples/unit_convert/data/vall.jsonl (relative to {ROOT})")


def test_a_file_with_other_field_names_is_named_once_and_mapped_by_data_fields(tmp_path, capsys):
    """Issue 43: a question/answer JSONL is refused with the field, the file and what it has; data.fields maps
    it (tests/data/test_data_formats.py reads every format with the mapping)."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(f'{{"question": "What is {i} + {i}?", "answer": {2 * i}}}\n' for i in range(3)))
    out = run_main(capsys, UNIT, f"data.train_path={data}")
    assert_one_line_exit_2(out, f"config error: data.train_path: {data}: no row has the field 'prompt' "
                                "(data.fields.prompt); the rows have: question, answer; map yours, e.g. "
                                "data.fields.prompt: <one of them>")
    typo = run_main(capsys, UNIT, f"data.train_path={data}", "data.fields.prompt=question", "data.fields.answer=anser")
    assert_one_line_exit_2(typo, f"config error: data.train_path: {data}: no row has the field 'anser' "
                                 "(data.fields.answer); the rows have: question, answer")
    unknown = run_main(capsys, UNIT, "data.fields.question=prompt")
    assert_one_line_exit_2(unknown, "config error: data.fields.question")
    fmt = run_main(capsys, UNIT, "data.format=xlsx")
    assert_one_line_exit_2(fmt, "config error: data.format: 'xlsx' is not one of auto, jsonl, json, csv, parquet, "
                                "hf_disk")
