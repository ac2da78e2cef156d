"""Runner: the dataclass contract, and a real `ray start --head` + job submission of driver.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jobs.runner import Runner
from rayrl.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_required_fields_defaults_and_passthrough():
    with pytest.raises(ValueError, match="exp_id"):
        Runner(exp_id="", config="c.yaml")
    r = Runner(exp_id="e1", config="examples/calculator/config.yaml", steps=3, model_path="/m dir",
               overrides=["rollout.group_size=8"], extra_args=["--resume"], env_vars={"A": "1"})
    assert r.address == "http://127.0.0.1:8265" and r.working_dir == "."
    assert r.driver_args() == ["--config", "examples/calculator/config.yaml", "exp_id=e1", "model.path=/m dir",
                               "trainer.steps=3", "rollout.group_size=8", "--resume"]
    assert r.entrypoint().startswith(
        "python driver.py --config examples/calculator/config.yaml exp_id=e1 'model.path=/m dir'")
    env = r.runtime_env()
    assert env["working_dir"] == "." and env["env_vars"] == {"A": "1"} and ".venv" in env["excludes"]


def test_yaml_round_trip_and_unknown_fields(tmp_path):
    r = Runner(exp_id="e2", config="c.yaml", steps=5, overrides=["x.y=1"])
    path = tmp_path / "runner.yaml"
    r.to_yaml(path)
    assert Runner.from_yaml(path) == r
    assert Runner.from_yaml(r.to_yaml()) == r
    with pytest.raises(ValueError, match="unknown field"):
        Runner.from_yaml("exp_id: a\nconfig: b\ngpus: 8\n")


@pytest.mark.parametrize("env_address", ["local", "auto", "127.0.0.1:1"])
def test_the_runners_address_wins_over_ray_address_in_the_environment(monkeypatch, env_address):
    """Ray's job client takes RAY_ADDRESS (or RAY_API_SERVER_ADDRESS) from the environment over the address it
    is given; the runner's address must win, or a job goes to whichever Ray the environment names (with
    RAY_ADDRESS=local: any Ray on this machine, and none or two of them is an error). Nothing listens at the
    runner's address here, so the client's error names the address it tried."""
    monkeypatch.setenv("RAY_ADDRESS", env_address)
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", env_address)
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=url.replace(".", r"\.")):
        Runner(exp_id="addr", config="examples/calculator/config.yaml", address=url)._client()
    assert os.environ["RAY_ADDRESS"] == env_address == os.environ["RAY_API_SERVER_ADDRESS"]  # put back


@pytest.mark.slow  # ~2.5 min: a Ray head with its dashboard starts slowly on 2 cores (make test-slow)
def test_ray_job_submit_runs_driver(ray_head, tiny_model_dir, tmp_path):
    runner = Runner(
        exp_id="job-e2e",
        config="examples/calculator/config.yaml",
        address=ray_head,
        working_dir=str(ROOT),
        model_path=str(tiny_model_dir),
        steps=1,
        overrides=["engine.dtype=float32", "rollout.prompts_per_step=2", "rollout.group_size=2",
                   "rollout.max_tokens=8", "rollout.max_turns=1", "logging.tensorboard=false",
                   f"logging.output_dir={tmp_path / 'runs'}"],  # absolute: kept as it is on the driver's node
    )
    job_id = runner.submit()
    status = runner.wait(job_id, timeout_s=400)
    logs = runner.logs(job_id)
    assert status == "SUCCEEDED", logs[-3000:]
    assert "step 1/1 |" in logs and f"[rayrl] metrics: {tmp_path / 'runs' / 'job-e2e' / 'metrics.jsonl'}" in logs
