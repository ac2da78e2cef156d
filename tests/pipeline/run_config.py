"""The whole-pipeline tests' run config and what they read back from a run (tests/pipeline/, tests/multinode/)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from rayrl.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def pipeline_config(tmp_path: Path, model_dir: Path, *overrides: str) -> RunConfig:
    """The calculator example on the tiny model, 16 tasks, two steps of 2 groups of 2: the whole-pipeline
    tests' base, ``overrides`` on top."""
    data = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t-{i}", "prompt": f"What is {i} + 1?", "metadata": {"question": f"What is {i} + 1?",
             "answer": i + 1}} for i in range(16)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return load_config(
        ROOT / "examples" / "calculator" / "config.yaml",
        [
            f"model.path={model_dir}",
            f"logging.output_dir={tmp_path / 'runs'}",
            f"data.train_path={data}",
            "data.shuffle=false",
            "engine.dtype=float32",
            "rollout.agent=tests.pipeline.pipeline_support:SlowToolAgent",
            "rollout.reward=tests.pipeline.pipeline_support:index_reward",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_tokens=8",
            "rollout.episode_timeout_s=60",
            "trainer.steps=2",
            "trainer.micro_batch_tokens=2048",
            "sandbox_pool.min_warm=2",
            "logging.tensorboard=false",
            "logging.plot=false",
            *overrides,
        ],
    )


def engine_version(url: str) -> str:
    """The weight version the engine at ``url`` serves."""
    with urllib.request.urlopen(f"{url}/model_info", timeout=10) as resp:
        return json.load(resp)["weight_version"]


def step_episodes(cfg: RunConfig, step: int) -> list[dict]:
    """The rows of ``episodes/`` for ``step``."""
    path = cfg.run_dir / "episodes" / f"step{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
