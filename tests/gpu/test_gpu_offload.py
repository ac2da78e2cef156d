"""The torch trainer's offload on a GPU (issue 20 item 1): after a training step, ``offload()`` gives the
driver back at least params + grads + Adam's two moments (in their dtypes), measured with
``torch.cuda.mem_get_info``; ``onload()`` restores every byte; training goes on; a second cycle reuses
the pinned host buffer. Records freed bytes, copy rates and step times in $OUT/torch_offload.json."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from _gpu_kit import gpu_memory_used_bytes, need, record

from rayrl.config import TrainerConfig
from rayrl.types import Sample

pytestmark = pytest.mark.gpu
GIB = 2**30


def _samples(n: int, seed: int, vocab: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(3, vocab, size=256).astype(np.int32)
        out.append(Sample(tokens=tokens, prompt_length=64, loss_mask=np.ones(192, np.int8),
                          rollout_logprobs=np.full(192, -10.0, np.float32), policy_versions=np.zeros(192, np.int32)))
    return out


def _host_copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().to("cpu", copy=True) for t in tensors]


def test_torch_trainer_offload_frees_params_grads_and_adam_state(medium_qwen2_dir):
    need("torch_memory_saver")
    from rayrl.trainers.torch_backend import TorchTrainer

    cfg = TrainerConfig(memory_saver=True, lr=1e-5, micro_batch_tokens=4096, compute_dtype="bfloat16")
    trainer = TorchTrainer(medium_qwen2_dir, cfg, device="cuda")
    assert trainer.memory.active
    samples = _samples(8, seed=0, vocab=32000)
    started = time.perf_counter()
    first = trainer.train_step(samples, [1.0, -1.0] * 4)  # Adam would make its moments here, lazily
    first_step_s = time.perf_counter() - started
    params = list(trainer.model.parameters())
    grads = [p.grad for p in params]
    moments = [st[k] for st in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    sizes = {"params": sum(t.nbytes for t in params), "grads": sum(t.nbytes for t in grads),
             "adam_moments": sum(t.nbytes for t in moments)}  # fmt: skip
    expected = sum(sizes.values())
    outside = trainer.memory.bytes_outside(params + grads + moments)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # measure the region alone, not the activations' cache that pause also returns
    before = gpu_memory_used_bytes()
    kept_params, kept_moments = _host_copy(params), _host_copy(moments)
    cycles = []
    for _ in range(2):
        used = gpu_memory_used_bytes()
        assert trainer.offload()
        freed = used - gpu_memory_used_bytes()
        assert trainer.onload()
        cycles.append({"freed_bytes": freed, "regained_bytes": gpu_memory_used_bytes() - (used - freed),
                       **trainer.memory.last_cycle})  # fmt: skip
    restored = all(torch.equal(a.cpu(), b) for a, b in zip(params, kept_params)) and all(
        torch.equal(a.cpu(), b) for a, b in zip(moments, kept_moments))  # fmt: skip
    started = time.perf_counter()
    second = trainer.train_step(_samples(8, seed=1, vocab=32000), [1.0, -1.0] * 4)
    second_step_s = time.perf_counter() - started
    record("torch_offload", {
        "device": torch.cuda.get_device_name(), "expected_bytes": expected, **sizes, "bytes_outside_region": outside,
        "used_before_offload_bytes": before, "first_step_s": first_step_s, "step_after_onload_s": second_step_s,
        "cycles": [{**c, "freed_over_expected": c["freed_bytes"] / expected,
                    "pause_gib_per_s": c["bytes"] / GIB / c["pause_copy_s"],
                    "resume_gib_per_s": c["bytes"] / GIB / c["resume_copy_s"]} for c in cycles],
        "loss_first": first["loss"], "loss_second": second["loss"],
    })  # fmt: skip
    assert outside == 0  # every byte offload must free is in the region
    for c in cycles:
        assert c["freed_bytes"] >= 0.98 * expected, c  # params + grads + both moments left the GPU
        assert c["freed_bytes"] <= 1.25 * expected + 256 * 2**20, c  # and not much else (no temporaries)
        assert c["regained_bytes"] >= 0.98 * expected, c
    assert restored
    assert cycles[1]["host_buffers_made"] == 1  # the second cycle reused the pinned host buffer
    assert np.isfinite(second["loss"]) and second["policy_version"] == 2


def test_the_reference_model_leaves_the_gpu_with_the_trainer(medium_qwen2_dir):
    """With a KL to a reference model (issue 30 point 4), the frozen reference is allocated inside the same
    memory-saver region: offload frees its weights too, onload restores them bit for bit, and the KL to
    it is 0 before the first update (reference = initial weights) and positive after."""
    need("torch_memory_saver")
    from rayrl.config import AlgorithmConfig
    from rayrl.trainers.torch_backend import TorchTrainer

    cfg = TrainerConfig(memory_saver=True, lr=1e-4, micro_batch_tokens=4096, compute_dtype="bfloat16")
    trainer = TorchTrainer(medium_qwen2_dir, cfg, algorithm=AlgorithmConfig(kl_loss_coef=0.1), device="cuda")
    assert trainer.reference is not None
    ref_params = list(trainer.reference.parameters())
    first = trainer.train_step(_samples(8, seed=0, vocab=32000), [1.0, -1.0] * 4)
    assert trainer.memory.bytes_outside(ref_params) == 0
    ref_bytes = sum(p.nbytes for p in ref_params)
    policy_bytes = sum(p.nbytes for p in trainer.model.parameters()) * 4  # params, grads, two Adam moments (fp32)
    kept = _host_copy(ref_params)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    used = gpu_memory_used_bytes()
    assert trainer.offload()
    freed = used - gpu_memory_used_bytes()
    assert trainer.onload()
    record("torch_offload_reference", {"device": torch.cuda.get_device_name(), "reference_bytes": ref_bytes,
                                       "policy_state_bytes": policy_bytes, "freed_bytes": freed,
                                       "ref_kl_first": first["ref_kl_mean"]})
    assert freed >= 0.98 * (policy_bytes + ref_bytes)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(ref_params, kept))
    second = trainer.train_step(_samples(8, seed=1, vocab=32000), [1.0, -1.0] * 4)
    assert abs(first["ref_kl_mean"]) < 1e-3 and second["ref_kl_mean"] > 0
