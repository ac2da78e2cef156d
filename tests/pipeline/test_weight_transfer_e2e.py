"""``pipeline.weight_transfer``: the pipeline moves weights from the trainer to the engines without disk,
as on GPU, here with the same code on CPU: a gloo broadcast group (``distributed``) or shared-memory
handles (``tensor``; CUDA IPC on GPU). After each step the engines hold exactly the trainer's weights,
and an engine whose actor is killed comes back, rejoins the group and gets them again."""

from __future__ import annotations

import asyncio
import os

import pytest
import ray
import torch
from safetensors.torch import load_file

from rayrl.engines.client import EngineClient
from tests.engines._engine_kit import forward_logprobs
from tests.pipeline.run_config import engine_version, pipeline_config

PROMPT = [1, 15, 27, 300, 41, 9, 77]


def _engine_logprobs(url: str) -> tuple[list[int], torch.Tensor]:
    async def go():
        client = EngineClient(url)
        try:
            return await client.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
        finally:
            await client.close()

    res = asyncio.run(go())
    return [int(i) for i in res.output_ids], torch.tensor(res.output_logprobs, dtype=torch.float32)


def _trainer_model(pipe, tiny_model_dir, directory):
    """The tiny model with the trainer's current weights (float32), to compare the engine against."""
    from transformers import AutoModelForCausalLM

    path = pipe.trainer.export_weights(str(directory), pipe.version, "float32")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=False)
    return model


def _assert_engine_has_trainer_weights(pipe, tiny_model_dir, directory) -> None:
    url = pipe.engine_urls[0]
    assert engine_version(url) == str(pipe.version)
    output_ids, logprobs = _engine_logprobs(url)
    expected = forward_logprobs(_trainer_model(pipe, tiny_model_dir, directory), PROMPT, output_ids)
    torch.testing.assert_close(logprobs, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("transfer", "schedule"), [
    # ~35 s; tests/weights/test_weight_transfer.py covers gloo
    pytest.param("distributed", "async", marks=pytest.mark.slow),
    # ~70 s; fast: the colocated_async e2e in test_schedules_e2e pushes over the same tensor transport
    pytest.param("tensor", "colocated_async", marks=pytest.mark.slow),
])
def test_weights_reach_the_engines_without_disk(ray_local, tiny_model_dir, tmp_path, transfer, schedule):
    from actors.pipeline import Pipeline

    cfg = pipeline_config(tmp_path, tiny_model_dir, f"exp_id=wt-{transfer}-{os.getpid()}",
                          f"pipeline.schedule={schedule}", f"pipeline.weight_transfer={transfer}", "trainer.steps=3",
                          "engine.weight_format=float32")  # exact numbers: the transfer, not the packing, is checked
    pipe = Pipeline(cfg)
    try:
        assert pipe.weights.transport == transfer
        pipe.run_step()
        pipe.run_step()
        assert pipe.version == 2  # index_reward gives every group variance: each step trains
        _assert_engine_has_trainer_weights(pipe, tiny_model_dir, tmp_path / "check")
        assert not os.path.exists(pipe.weights.disk_root)  # nothing went through /dev/shm files

        if transfer == "distributed":  # a new engine is outside the old group: it must rejoin
            ray.kill(pipe.engines.slots[0].actor)
            metrics = pipe.run_step()
            while pipe.engines.slots[0].state != "live":
                assert pipe.step < 6, metrics
                metrics = pipe.run_step()
            assert pipe.failure_counts["engine_restarts"] == 1
            _assert_engine_has_trainer_weights(pipe, tiny_model_dir, tmp_path / "check-after-restart")
    finally:
        pipe.shutdown()
