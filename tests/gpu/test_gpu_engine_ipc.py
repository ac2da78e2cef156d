"""A CUDA IPC weight update of SmolLM2 into our engine running on CUDA (issue 20 item 3): the engine
server is a real subprocess (``python -m rayrl.engines.cpu --device cuda``); the torch trainer
on the same GPU loads the same checkpoint (the engine's log-probs equal the trainer's: the engine runs
correctly on CUDA), takes GRPO steps (now they differ: the weights moved), and the sender the pipeline
builds for a colocated GPU layout (``plan_senders`` -> ``tensor`` -> HandleSender) posts its weights as
CUDA IPC handles to ``/update_weights_from_tensor``. Afterwards the engine's greedy tokens carry the new
version and their log-probs equal the trainer's own for the same tokens again. Figures in
$OUT/engine_ipc.json."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from _gpu_kit import record

from rayrl.config import EngineConfig, TrainerConfig
from rayrl.engines.client import EngineClient
from rayrl.engines.launcher import EngineProcess
from rayrl.trainers.torch_backend import TorchTrainer
from rayrl.types import Sample
from rayrl.weights.handles import HandleSender
from rayrl.weights.plan import EngineEndpoint, RankPlace, make_sender, plan_senders

pytestmark = pytest.mark.gpu

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
ATOL = 2e-3  # float32 on both sides, different attention kernels
STEPS = 2  # GRPO steps at lr 1e-4: enough to move the log-probs well past ATOL


def _logprobs(trainer: TorchTrainer, prompt: list[int], output: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.no_grad():
        logits = trainer.model(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu().numpy()


def _on_policy(trainer: TorchTrainer, prompt: list[int], output: list[int]) -> Sample:
    n = len(output)
    return Sample(tokens=np.array(prompt + output, dtype=np.int32), prompt_length=len(prompt),
                  loss_mask=np.ones(n, np.int8), rollout_logprobs=_logprobs(trainer, prompt, output),
                  policy_versions=np.zeros(n, np.int32))  # fmt: skip


def test_cuda_ipc_weight_update_into_our_engine_on_cuda(smollm2_gpu_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_gpu_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 times 23? Think step by step."}],
                                           add_generation_prompt=True, tokenize=True)  # fmt: skip
    engine_cfg = EngineConfig(dtype="float32", max_batch_size=4, context_length=2048, extra_args=["--device", "cuda"])
    engine = EngineProcess(engine_cfg, str(smollm2_gpu_dir), tmp_path / "engine.log").start(timeout_s=300)
    trainer = TorchTrainer(smollm2_gpu_dir, TrainerConfig(lr=1e-4, compute_dtype="float32", micro_batch_tokens=4096),
                           device="cuda")  # fmt: skip

    async def run() -> dict:
        client = EngineClient(engine.url)
        stale = await client.generate(prompt, GREEDY)
        stale_ids = stale.output_ids.tolist()
        initial = np.abs(stale.output_logprobs - _logprobs(trainer, prompt, stale_ids)).max()
        for _ in range(STEPS):  # away from the engine's greedy answer
            metrics = trainer.train_step([_on_policy(trainer, prompt, stale_ids)], [-1.0])
        before = np.abs(stale.output_logprobs - _logprobs(trainer, prompt, stale_ids)).max()
        plan = plan_senders("auto", [EngineEndpoint(engine.url, "node", bundles=(0,))],
                             [RankPlace(0, "node", bundle=0)], "sglang")  # the colocated GPU layout
        sender = make_sender(plan, 0, bucket_bytes=64 << 20, timeout_s=120, master_address="127.0.0.1",
                             disk_root=tmp_path / "weights", cuda=True)  # fmt: skip
        assert plan.transport == "tensor" and isinstance(sender, HandleSender)
        await sender.connect()
        stats = await sender.send(trainer.named_weights(torch.float32), version=1)
        await sender.close()
        fresh = await client.generate(prompt, GREEDY)
        expect = _logprobs(trainer, prompt, fresh.output_ids.tolist())
        info = await client.get_server_info()
        await client.close()
        return {"same_weights_max_abs": float(initial), "stale_vs_trainer_max_abs": float(before),
                "weight_version": fresh.weight_version,
                "max_abs_logprob_diff": float(np.abs(fresh.output_logprobs - expect).max()),
                "mean_abs_logprob_diff": float(np.abs(fresh.output_logprobs - expect).mean()),
                "tokens": len(fresh.output_ids), "changed_tokens": int((fresh.output_ids != stale.output_ids).sum()),
                "update_bytes": stats.bytes, "update_seconds": stats.seconds, "update_gb_per_s": stats.gb_per_s,
                "buckets": stats.buckets, "train_loss": metrics["loss"],
                "engine_weight_version": info.get("weight_version"),
                "text": tokenizer.decode(fresh.output_ids.tolist())}  # fmt: skip

    try:
        figures = asyncio.run(run())
    finally:
        engine.stop()
    record("engine_ipc", {"device": torch.cuda.get_device_name(), "model": str(smollm2_gpu_dir), **figures})
    assert figures["same_weights_max_abs"] < ATOL  # the engine on CUDA computes what the trainer computes
    assert figures["weight_version"] == "1"
    assert figures["stale_vs_trainer_max_abs"] > 10 * ATOL  # the engine had other weights before the update
    assert figures["max_abs_logprob_diff"] < ATOL  # now the trainer's, to float32 kernel noise
