"""MemorySaver on a GPU: pause gives back the region's memory (>= 90% of what it held), resume restores
every byte (parameters and Adam state) at the same addresses and training goes on; the Megatron trainer,
after a training step, frees its parameter and gradient buffers, fp32 main parameters and Adam's moments
(issue 20 item 1). Figures: $OUT/memory_saver.json, $OUT/megatron_offload.json."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from _gpu_kit import gpu_memory_used_bytes, need, record

from rayrl.types import Sample

pytestmark = pytest.mark.gpu


def test_pause_releases_and_resume_restores():
    need("torch_memory_saver")
    from rayrl.trainers.memory_saver import MemorySaver, init_optimizer_state

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = gpu_memory_used_bytes()
    saver = MemorySaver(enabled=True, tag="raw-test")
    assert saver.active
    with saver.region():
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, device="cuda") for _ in range(24)])  # ~1.6 GB
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        init_optimizer_state(optimizer)  # params + 2 moments ~ 4.8 GB, all inside
    x = torch.randn(64, 4096, device="cuda")
    model(x).square().mean().backward()  # gradients outside the region: freed by pause's empty_cache
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    params = [p.detach().cpu().clone() for p in model.parameters()]
    moments = [s["exp_avg"].detach().cpu().clone() for s in optimizer.state.values()]
    addresses = [p.data_ptr() for p in model.parameters()]
    held = gpu_memory_used_bytes() - baseline
    saver.pause()
    paused = gpu_memory_used_bytes() - baseline
    saver.resume()
    resumed = gpu_memory_used_bytes() - baseline
    released = 1.0 - paused / held
    record("memory_saver", {"trainer_gpu_bytes": held, "paused_gpu_bytes": paused, "resumed_gpu_bytes": resumed,
                            "released_fraction": released, "device": torch.cuda.get_device_name(),
                            **saver.last_cycle})  # fmt: skip
    assert held > 4e9
    assert released >= 0.90
    assert [p.data_ptr() for p in model.parameters()] == addresses
    assert all(torch.equal(p.detach().cpu(), q) for p, q in zip(model.parameters(), params))
    assert all(torch.equal(s["exp_avg"].cpu(), m) for s, m in zip(optimizer.state.values(), moments))
    loss = model(x).square().mean()  # the same tensors keep working after resume
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)


def _samples(n: int, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(3, 32000, size=256).astype(np.int32)
        out.append(Sample(tokens=tokens, prompt_length=64, loss_mask=np.ones(192, np.int8),
                          rollout_logprobs=np.full(192, -10.0, np.float32), policy_versions=np.zeros(192, np.int32)))
    return out


def _megatron_state(trainer) -> dict[str, list[torch.Tensor]]:
    """What offload must free: the DDP buffers (parameters, gradients), the optimizer's fp32 main
    parameters and Adam's moments."""
    from rayrl.trainers.memory_saver import _inner_optimizers

    params, grads = [], []
    for chunk in trainer.model:
        for buf in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            if buf.param_data is not None:  # distributed optimizer: parameters in one buffer
                params.append(buf.param_data)
            else:
                params.extend(buf.params)
            grads.append(buf.grad_data)
    inner = _inner_optimizers(trainer.optimizer)
    main = [p for opt in inner for g in opt.param_groups for p in g["params"]]
    moments = [st[k] for opt in inner for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq") if k in st]
    return {"params": params, "grads": grads, "main_params": main, "adam_moments": moments}


def test_megatron_trainer_offload_frees_what_it_holds(medium_qwen2_dir):
    need("torch_memory_saver", "megatron.core", "mbridge", "transformer_engine.pytorch")
    from rayrl.config import TrainerConfig
    from rayrl.ports import free_port
    from rayrl.trainers.megatron_backend import MegatronTrainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    cfg = TrainerConfig(backend="megatron", dtype="bfloat16", memory_saver=True, lr=1e-5,
                        micro_batch_tokens=4096)  # fmt: skip
    trainer = MegatronTrainer(medium_qwen2_dir, cfg, rank=0, world_size=1, local_rank=0)
    metrics = trainer.train_step(_samples(8, seed=0), [1.0, -1.0] * 4)  # Adam's first step
    state = _megatron_state(trainer)
    sizes = {name: sum(t.nbytes for t in ts) for name, ts in state.items()}
    expected = sum(sizes.values())
    outside = {name: trainer.memory.bytes_outside(ts) for name, ts in state.items()}
    before = {n: t.detach().cpu().clone() for n, t in trainer.named_weights()}
    kept_moments = [t.detach().cpu().clone() for t in state["adam_moments"]]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    used = gpu_memory_used_bytes()
    assert trainer.offload()
    freed = used - gpu_memory_used_bytes()
    assert trainer.onload()
    record("megatron_offload", {"device": torch.cuda.get_device_name(), **sizes, "expected_bytes": expected,
                                "freed_bytes": freed, "freed_over_expected": freed / expected,
                                "bytes_outside_region": outside, "train_time_s": metrics["train_time_s"],
                                **trainer.memory.last_cycle})  # fmt: skip
    assert sizes["adam_moments"] > 0 and all(v == 0 for v in outside.values()), outside
    assert freed >= 0.98 * expected
    for n, t in trainer.named_weights():
        assert torch.equal(t.detach().cpu(), before[n]), n
    assert all(torch.equal(a.cpu(), b) for a, b in zip(state["adam_moments"], kept_moments))
    again = trainer.train_step(_samples(8, seed=1), [1.0, -1.0] * 4)
    assert again["update_successful"] and again["policy_version"] == 2



EXIT_SCRIPT = r"""
import torch
from rayrl.trainers.memory_saver import MemorySaver, _hook_mode, init_optimizer_state


def gpu_memory_used_bytes():  # as tests/gpu/_gpu_kit.py's (this script runs in its own interpreter)
    free, total = torch.cuda.mem_get_info()
    return total - free


saver = MemorySaver(enabled=True, tag="exit-test")
with saver.region():
    model = torch.nn.Linear(4096, 4096, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    init_optimizer_state(optimizer)
model(torch.randn(8, 4096, device="cuda")).sum().backward()
optimizer.step()
before = [p.detach().cpu().clone() for p in model.parameters()]
torch.cuda.synchronize()
held = gpu_memory_used_bytes()
saver.pause()
paused = gpu_memory_used_bytes()
saver.resume()
same = all(torch.equal(p.detach().cpu(), q) for p, q in zip(model.parameters(), before))
torch.cuda.synchronize()
print("WORK DONE", _hook_mode(), held - paused, same, flush=True)
"""


def test_a_trainer_process_exits_cleanly_in_the_mode_its_ranks_use():
    """torch_memory_saver's torch hook mode calls exit(1) when region memory is freed outside a region, which
    interpreter teardown does; trainer ranks are therefore started with the preload hook (preload_env). A
    process started that way pauses, restores every byte and exits 0; the torch-mode outcome is recorded."""
    need("torch_memory_saver")
    import subprocess
    import sys

    from rayrl.trainers.saver_preload import preload_env

    outcomes = {}
    for mode, env in (("preload", preload_env(True)), ("torch", {"LD_PRELOAD": ""})):
        done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "LD_PRELOAD": "", **env})  # fmt: skip
        outcomes[mode] = done
        record(f"memory_saver_exit_{mode}", {"returncode": done.returncode, "stdout": done.stdout[-300:],
                                              "stderr_tail": done.stderr[-600:]})  # fmt: skip
    done = outcomes["preload"]
    assert "WORK DONE preload" in done.stdout, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "True", done.stdout  # every byte back after the pause
    assert "only support interesting region" not in done.stdout + done.stderr
    assert done.returncode == 0, done.stderr[-2000:]
