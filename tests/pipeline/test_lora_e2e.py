"""trainer.lora in a real pipeline run (local Ray, tiny random model, the CPU engine): the engines load the
adapter before the first rollout and after every step, every request names it, the KL's reference is
the base with the adapter off, the checkpoint holds the adapter alone and the run ends with the adapter
in PEFT's format (and the merged model), which PEFT and transformers load."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch

from rayrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~1-2 min; fast: tests/trainers/test_lora_trainer.py, tests/weights/test_lora_engine.py
def test_two_lora_steps_end_to_end(ray_local, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from actors.pipeline import Pipeline

    data = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t-{i}", "prompt": f"What is {i} + 1?", "metadata": {"question": f"What is {i} + 1?",
             "answer": i + 1}} for i in range(6)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(ROOT / "examples" / "calculator" / "config.yaml", [
        f"model.path={tiny_model_dir}", "exp_id=lora", f"logging.output_dir={tmp_path / 'runs'}",
        f"data.train_path={data}", "data.shuffle=false", "engine.dtype=float32",
        "rollout.agent=tests.e2e_support:IndexedAgent", "rollout.reward=tests.e2e_support:index_parity_reward",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens=8", "rollout.max_turns=1",
        "rollout.episode_timeout_s=30", "trainer.steps=2", "trainer.micro_batch_tokens=2048",
        "trainer.lr=0.05", "trainer.lora.rank=4", "trainer.lora.export_merged=true",
        "algorithm.kl_loss_coef=0.05", "sandbox_pool.min_warm=2", "logging.inspect_episodes_per_step=0",
    ])
    pipeline = Pipeline(cfg)
    try:
        history = pipeline.run()
        assert len(history) == 2 and pipeline.version == 2
        assert all(h["train/trained_samples"] == 4 for h in history)
        assert history[0]["train/ref_kl_mean"] == pytest.approx(0.0, abs=1e-6)  # B = 0: policy is the base
        assert history[1]["train/ref_kl_mean"] > 0  # the adapter moved; the reference did not
        for url in pipeline.engine_urls:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
                assert [c["id"] for c in json.load(resp)["data"] if c["parent"]] == ["policy"]
            with urllib.request.urlopen(f"{url}/model_info", timeout=10) as resp:
                assert json.load(resp)["weight_version"] == "2"
            with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as resp:
                calls = json.load(resp)["control_calls"]
            # version 0 before any rollout, then after each step: unload, load, version
            assert calls.count("load_lora_adapter_from_tensors") == 3 and calls.count("unload_lora_adapter") == 2
            assert "update_weights_from_tensor" not in calls
        rows = [json.loads(line) for step in (1, 2)
                for line in (cfg.run_dir / "episodes" / f"step{step:06d}.jsonl").read_text().splitlines()]
        assert len(rows) == 8 and all(r["status"] == "ok" for r in rows)  # every request named the adapter
        checkpoint = Path(pipeline.checkpoints.latest())
        saved = torch.load(checkpoint / "rank0.pt", weights_only=False)
        assert saved["lora_rank"] == 4 and all(".lora_" in n for n in saved["model"])
    finally:
        pipeline.shutdown()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ids = torch.tensor([[11, 200, 3050, 42, 7]])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, str(cfg.run_dir / "adapter")).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(cfg.run_dir / "merged"), dtype=torch.float32)(ids).logits
    assert torch.allclose(adapted, merged, atol=1e-5)
