"""One colocated step on one GPU in the fixed order (issue 25 point 1), with the real torch_memory_saver and
SGLang 0.5.9's own receive path: the engine is our engine on CUDA as the strict SGLang stand-in
(``python -m rayrl.engines.cpu --device cuda --strict-sglang``: payloads through SGLang's MultiprocessingSerializer with
its patched CUDA rebuild, buckets cut by SGLang's FlattenedTensorBucket), the trainer is the torch
backend with ``trainer.memory_saver`` (parameters, gradients and Adam's moments in a torch_memory_saver
region). The cycle is colocated_async's (rayrl/orchestration/schedules.py): engines pause and release;
trainer onload; a GRPO step; engines resume their weights; the push from the trainer's live memory over
CUDA IPC; trainer offload; engines resume the KV cache and continue. It checks that nothing reads
unmapped memory (no CUDA error, the process goes on) and that the engine then computes exactly what the
trainer computes. Then the old order (offload, then push) runs in a subprocess of its own, and its
outcome is recorded: there the export reads memory the saver has unmapped. Figures in
$OUT/colocated_cycle.json."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from _gpu_kit import need, record

from rayrl.config import EngineConfig, TrainerConfig
from rayrl.engines.client import EngineClient
from rayrl.engines.launcher import EngineProcess
from rayrl.types import Sample
from rayrl.weights.handles import HandleSender
from rayrl.weights.transfer import EngineTarget

pytestmark = pytest.mark.gpu

GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
ATOL = 2e-3

OLD_ORDER = r"""
import asyncio, sys, torch
from rayrl.config import TrainerConfig
from rayrl.trainers.torch_backend import TorchTrainer
from rayrl.weights.handles import HandleSender
from rayrl.weights.transfer import EngineTarget
from rayrl.engines.client import EngineClient
trainer = TorchTrainer(sys.argv[1], TrainerConfig(memory_saver=True, compute_dtype="float32"), device="cuda")
trainer.offload()  # main's order: offload first ...
sender = HandleSender([EngineTarget(EngineClient(sys.argv[2]))], sglang_engines=True)
asyncio.run(sender.send(trainer.named_weights(torch.float32), 99))  # ... then read the weights to push them
torch.cuda.synchronize()
print("OLD ORDER COMPLETED")
"""


def _logprobs(trainer, prompt: list[int], output: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.no_grad():
        logits = trainer.model(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(-1, ids[0, len(prompt):, None])[:, 0].cpu().numpy()


def test_colocated_cycle_in_the_fixed_order(smollm2_gpu_dir, tmp_path):
    need("torch_memory_saver", "sglang.srt.utils", "sglang.srt.weight_sync.tensor_bucket")
    from rayrl.trainers.torch_backend import TorchTrainer

    engine_cfg = EngineConfig(dtype="float32", max_batch_size=4, context_length=1024,
                              extra_args=["--device", "cuda", "--strict-sglang"])
    engine = EngineProcess(engine_cfg, str(smollm2_gpu_dir), tmp_path / "engine.log").start(timeout_s=240)
    trainer = TorchTrainer(smollm2_gpu_dir, TrainerConfig(memory_saver=True, lr=1e-4, compute_dtype="float32",
                                                          micro_batch_tokens=2048), device="cuda")
    assert trainer.memory.active
    prompt = list(range(100, 140))
    figures: dict = {"device": torch.cuda.get_device_name()}

    async def cycle() -> None:
        client = EngineClient(engine.url)
        stale = await client.generate(prompt, GREEDY)
        ids = stale.output_ids.tolist()
        trainer.offload()  # colocated: the engines hold the device outside the train phase
        await client.pause_generation("in_place")
        await client.release_memory_occupation(None)
        started = time.perf_counter()
        trainer.onload()
        figures["onload_s"] = time.perf_counter() - started
        sample = Sample(tokens=np.array(prompt + ids, np.int32), prompt_length=len(prompt),
                        loss_mask=np.ones(len(ids), np.int8), rollout_logprobs=stale.output_logprobs.astype(np.float32),
                        policy_versions=np.zeros(len(ids), np.int32))
        for _ in range(2):
            trainer.train_step([sample], [-1.0])
        await client.resume_memory_occupation(["weights"])
        sender = HandleSender([EngineTarget(client)], bucket_bytes=64 << 20, sglang_engines=True)
        stats = await sender.send(trainer.named_weights(torch.float32), 1)  # live memory, before offload
        torch.cuda.synchronize()  # no illegal memory access
        started = time.perf_counter()
        trainer.offload()
        figures["offload_s"] = time.perf_counter() - started
        await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
        await client.continue_generation()
        fresh = await client.generate(prompt, GREEDY)
        trainer.onload()  # the trainer's own answer for the same tokens, contents restored by the saver
        expect_fresh = _logprobs(trainer, prompt, fresh.output_ids.tolist())
        info = await client.get_server_info()
        await client.close()
        figures.update(
            push_gb_per_s=stats.gb_per_s, push_buckets=stats.buckets, push_bytes=stats.bytes,
            weight_version=fresh.weight_version,
            stale_vs_trainer_max_abs=float(np.abs(stale.output_logprobs - _logprobs(trainer, prompt, ids)).max()),
            engine_vs_trainer_max_abs=float(np.abs(fresh.output_logprobs - expect_fresh).max()),
            sglang_contract=info["sglang_contract"],
        )

    try:
        asyncio.run(cycle())
        old = subprocess.run([sys.executable, "-c", OLD_ORDER, str(smollm2_gpu_dir), engine.url],
                             capture_output=True, text=True, timeout=120)
        tail = (old.stdout + old.stderr).strip().splitlines()[-3:]
        figures["old_order"] = {"returncode": old.returncode, "completed": "OLD ORDER COMPLETED" in old.stdout,
                                "tail": tail}
    finally:
        engine.stop()
    record("colocated_cycle", figures)
    assert figures["weight_version"] == "1"
    assert figures["stale_vs_trainer_max_abs"] > 10 * ATOL  # the step moved the weights
    assert figures["engine_vs_trainer_max_abs"] < ATOL  # the engine has exactly the trainer's new weights
    contract = figures["sglang_contract"]
    assert contract["contract_violations"] == contract["mixed_weight_generations"] == 0
