"""examples/gsm8k: the 8xH100 colocated config loads and validates on a machine without a GPU, its
placement plan fits, its task rows score with the gsm8k reward, and make_data.py converts GSM8K rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rayrl.agents.base import AgentResult
from rayrl.config import ConfigError, load_config
from rayrl.data.dataset import FileDataset
from rayrl.machine import Machine
from rayrl.placement import plan_placement
from rayrl.resolve import load_checked, resolve
from rayrl.rewards import get_reward_fn

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gsm8k"


def test_config_loads_and_fits_8_gpus():
    cfg = load_config(EXAMPLE / "config.yaml")
    assert cfg.engine.backend == "sglang" and cfg.trainer.backend == "megatron"
    assert cfg.placement.mode == "colocated" and cfg.trainer.memory_saver and cfg.engine.sglang.enable_memory_saver
    plan = plan_placement(cfg.placement.mode, cfg.placement.num_gpus, trainer_ranks=cfg.trainer.num_ranks,
                          num_engines=cfg.engine.num_engines, tp_size=cfg.engine.tp_size)  # fmt: skip
    assert plan.trainer_bundles == tuple(range(8)) and len(plan.engine_bundles) == 8
    resolved = resolve(cfg, Machine(cores=16, cuda=True))
    assert resolved.algorithm.tis_cap == 2.0  # colocated_async: off-policy correction on by default
    with pytest.raises(ConfigError, match="placement.num_gpus"):
        load_checked(EXAMPLE / "config.yaml", ["engine.num_engines=4"])  # 4 engines cannot share 8 GPUs


def test_rows_score_with_the_gsm8k_reward():
    reward = get_reward_fn("gsm8k")
    for split in ("train", "test"):
        tasks = list(FileDataset(EXAMPLE / "data" / f"{split}.jsonl"))
        assert tasks
        for task in tasks:
            answer = task.metadata["answer"]
            right = AgentResult(status="completed", final_answer=f"So the answer is #### {answer}")
            wrong = AgentResult(status="completed", final_answer=f"#### {answer + 1}")
            assert reward(task, right) == 1.0 and reward(task, wrong) == 0.0
            assert task.metadata["solution"].rstrip().endswith(f"#### {answer}")


def test_make_data_converts_gsm8k_jsonl(tmp_path):
    src = tmp_path / "test.jsonl"
    rows = [{"question": "Ann has 3 bags of 4 apples. How many apples?", "answer": "3 * 4 = 12\n#### 12"},
            {"question": "A book costs $1,250 and ships for $50. Total?",
             "answer": "1,250 + 50 = 1,300\n#### 1,300"}]  # fmt: skip
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tasks.jsonl"
    run = subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "--input", str(src), "--out", str(out)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    tasks = list(FileDataset(out))
    assert [t.metadata["answer"] for t in tasks] == [12, 1300]
    assert tasks[0].prompt == rows[0]["question"] and tasks[0].task_id == "gsm8k-test-00000"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final number"}) + "\n")
    run = subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "--input", str(bad), "--out", str(out)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode != 0 and "####" in run.stderr
