"""``engine.weight_format`` and ``engine.max_logprob_gap`` through a real pipeline (local Ray, CPU engine
subprocess, trainer, gateway, sandboxes) on the tiny model: the engine decodes with fp16-packed weights,
repacks them at every weight update (``engine/weight_pack_s``), the trainer reports the engine-trainer gap,
and a gap above the bound switches the engine to float32 once, after which the gap is float32's."""

from __future__ import annotations

import json
import logging
import os
import urllib.request

import pytest

from tests.pipeline.run_config import pipeline_config


def _engine_state(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as resp:
        return json.load(resp)["internal_states"][0]


@pytest.mark.slow  # ~80 s; fast: test_logprob_gap (gap_crossed, the meter) and the /set_weight_format HTTP test
def test_packed_engine_falls_back_to_float32_past_the_gap_bound(ray_local, tiny_model_dir, tmp_path, caplog):
    from actors.pipeline import Pipeline

    cfg = pipeline_config(tmp_path, tiny_model_dir, f"exp_id=wf-{os.getpid()}", "trainer.steps=2",
                          "engine.weight_format=fp16-packed",
                          "engine.max_logprob_gap=1e-6",  # fp16 weights always cross it: the fallback must happen
                          "trainer.compute_dtype=float32")  # not auto: a bf16 trainer's own gap would hide the fallback
    pipe = Pipeline(cfg)
    try:
        url = pipe.engine_urls[0]
        assert _engine_state(url)["weight_format"] == "fp16-packed"
        with caplog.at_level(logging.WARNING, logger="rayrl"):
            first = pipe.run_step()
            second = pipe.run_step()
        state = _engine_state(url)
        calls = _control_calls(url)
    finally:
        pipe.shutdown()
    assert first["train/engine_gap/tokens"] > 0 and first["train/engine_gap/mean_abs"] > 1e-6
    assert first["train/engine_gap/max_abs"] >= first["train/engine_gap/mean_abs"]
    assert first["engine/weight_pack_s"] > 0  # step 1's update was repacked (and the fallback packed float32)
    assert first["engine/float32_fallback"] == second["engine/float32_fallback"] == 1.0
    assert state["weight_format"] == "float32" and calls.count("set_weight_format") == 1
    # step 2 sampled with float32 engine weights, against the float32 trainer: only kernel rounding is left
    assert second["train/engine_gap/mean_abs"] < first["train/engine_gap/mean_abs"] / 10
    said = [r for r in caplog.records if "engine.max_logprob_gap" in r.getMessage()]
    assert len(said) == 1  # said once, not at every step


def _control_calls(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as resp:
        return json.load(resp)["control_calls"]
