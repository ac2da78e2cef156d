"""Megatron through mbridge on one GPU: a model built from a HF config gives the HF model's log-probs,
exports the same HF-named weights, takes a GRPO step with rayrl's loss, and checkpoints."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from _gpu_kit import need, record

from rayrl.config import TrainerConfig
from rayrl.ports import free_port
from rayrl.types import Sample

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def trainer(tiny_qwen2_dir):
    need("megatron.core", "mbridge", "transformer_engine.pytorch")
    from rayrl.trainers.megatron_backend import MegatronTrainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    cfg = TrainerConfig(backend="megatron", dtype="bfloat16", lr=1e-3, micro_batch_tokens=256,
                        grad_clip=1.0)  # fmt: skip
    return MegatronTrainer(tiny_qwen2_dir, cfg, rank=0, world_size=1, seed=0, local_rank=0)


def _samples(n: int, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(24, 64))
        tokens = rng.integers(3, 1000, size=length).astype(np.int32)
        resp = length - 8
        out.append(Sample(tokens=tokens, prompt_length=8, loss_mask=np.ones(resp, np.int8),
                          rollout_logprobs=np.zeros(resp, np.float32), policy_versions=np.zeros(resp, np.int32)))
    return out


def _hf_logprobs(model_dir, samples: list[Sample]) -> list[np.ndarray]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(s.tokens.astype(np.int64))[None].cuda()
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
            out.append(logp[s.prompt_length - 1 : -1].gather(1, ids[0, s.prompt_length :, None])[:, 0].cpu().numpy())
    del hf
    torch.cuda.empty_cache()
    return out


def test_megatron_matches_hf(trainer, tiny_qwen2_dir):
    samples = _samples(6, seed=0)
    ours = trainer.token_logprobs(samples)
    ref = _hf_logprobs(tiny_qwen2_dir, samples)
    diff = np.concatenate([np.abs(a - b) for a, b in zip(ours, ref)])
    spread = float(np.concatenate(ref).std())
    record("megatron_vs_hf", {"mean_abs_logprob_diff": float(diff.mean()), "max_abs_logprob_diff": float(diff.max()),
                              "hf_logprob_std": spread, "tokens": int(diff.size), "megatron_dtype": "bfloat16"})
    assert spread > 0.1  # the reference is not uniform, so agreement means something
    assert diff.mean() < 0.03 and diff.max() < 0.3  # bf16 Megatron vs fp32 HF


def test_export_gives_hf_names_and_values(trainer, tiny_qwen2_dir):
    from safetensors.torch import load_file

    hf = {}
    for f in sorted(tiny_qwen2_dir.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    exported = {name: t.detach().cpu() for name, t in trainer.named_weights()}
    assert set(exported) == set(hf)
    for name, t in exported.items():
        assert tuple(t.shape) == tuple(hf[name].shape), name
        assert torch.equal(t.to(torch.bfloat16), hf[name].to(torch.bfloat16)), name  # loaded, then exported


def test_one_grpo_step_with_rayrl_loss(trainer):
    samples = _samples(4, seed=1)
    for s, lp in zip(samples, trainer.token_logprobs(samples)):
        s.rollout_logprobs = lp.astype(np.float32)  # on-policy
    samples[1].loss_mask[:5] = 0
    before = [float(lp.sum()) for lp in trainer.token_logprobs(samples)]
    metrics = trainer.train_step(samples, [1.0, -1.0, 1.0, -1.0])
    after = [float(lp.sum()) for lp in trainer.token_logprobs(samples)]
    record("megatron_train_step", {k: v for k, v in metrics.items() if isinstance(v, (int, float, bool))})
    assert metrics["update_successful"] and metrics["policy_version"] == 1
    assert metrics["trained_tokens"] == sum(int(s.loss_mask.sum()) for s in samples)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert metrics["logprob_abs_diff"] < 2e-2  # the trainer agrees with the rollout log-probs it was given
    assert after[0] > before[0] and after[2] > before[2]
    assert after[1] < before[1] and after[3] < before[3]


def test_checkpoint_round_trip(trainer, tmp_path):
    samples = _samples(2, seed=2)
    saved_version = trainer.policy_version
    trainer.save_checkpoint(tmp_path / "ckpt")
    saved = {n: t.detach().cpu().clone() for n, t in trainer.named_weights()}
    trainer.train_step(samples, [1.0, -1.0])
    trainer.load_checkpoint(tmp_path / "ckpt")
    assert trainer.policy_version == saved_version
    for n, t in trainer.named_weights():
        assert torch.equal(t.detach().cpu(), saved[n]), n


def test_several_updates_reference_entropy_and_the_same_loss_as_torch(tiny_qwen2_dir):
    """Issue 30 on Megatron: a batch in 2 mini-batches x 2 epochs (proximal log-probs from a forward-only
    pass), a reference model (a second bridge model) with a KL loss, the vocab-parallel entropy bonus
    and the lr warm-up; and the first step's loss equals the torch backend's on the same batch and
    weights (bf16 tolerance)."""
    need("megatron.core", "mbridge", "transformer_engine.pytorch")
    from rayrl.config import AlgorithmConfig
    from rayrl.rl.updates import plan_updates
    from rayrl.trainers.megatron_backend import MegatronTrainer
    from rayrl.trainers.torch_backend import TorchTrainer

    algo = AlgorithmConfig(kl_loss_coef=0.1, entropy_coef=0.01, tis_cap=2.0)
    cfg = TrainerConfig(backend="megatron", dtype="bfloat16", lr=1e-3, micro_batch_tokens=128, grad_clip=1.0,
                        num_steps_per_rollout=2, epochs_per_rollout=2, steps=2, lr_warmup_steps=2)
    samples = _samples(4, seed=3)
    for s, lp in zip(samples, _hf_logprobs(tiny_qwen2_dir, samples)):
        s.rollout_logprobs = lp.astype(np.float32)
    advantages = [1.0, -1.0, 0.5, -0.5]
    single = TrainerConfig(backend="megatron", dtype="bfloat16", lr=1e-3, micro_batch_tokens=128, grad_clip=1.0)
    mega = MegatronTrainer(tiny_qwen2_dir, single, algorithm=algo, rank=0, world_size=1, seed=0, local_rank=0)
    torch_cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=128, grad_clip=1.0, compute_dtype="bfloat16")
    plain = TorchTrainer(tiny_qwen2_dir, torch_cfg, algorithm=algo, seed=0, device="cuda")
    m_mega, m_torch = mega.train_step(samples, advantages), plain.train_step(samples, advantages)
    record("megatron_vs_torch_loss", {k: (m_mega[k], m_torch[k]) for k in
                                      ("loss", "pg_loss", "entropy_mean", "ref_kl_mean", "clip_fraction")})
    assert m_mega["loss"] == pytest.approx(m_torch["loss"], rel=5e-2, abs=5e-3)
    assert m_mega["entropy_mean"] == pytest.approx(m_torch["entropy_mean"], rel=2e-2)
    assert abs(m_mega["ref_kl_mean"]) < 1e-2  # the reference is the initial weights
    del mega, plain
    torch.cuda.empty_cache()

    trainer = MegatronTrainer(tiny_qwen2_dir, cfg, algorithm=algo, rank=0, world_size=1, seed=0, local_rank=0)
    (keep, plan), = plan_updates(samples, advantages, algo, num_minibatches=2, epochs=2)
    metrics = trainer.train_step([samples[i] for i in keep], [advantages[i] for i in keep], plan)
    record("megatron_several_updates", {k: v for k, v in metrics.items() if isinstance(v, (int, float, bool))})
    assert metrics["update_successful"] and metrics["optimizer_steps"] == 4 and trainer.optimizer_steps == 4
    assert metrics["lr"] == pytest.approx(1e-3)  # past the 2 warm-up steps
    first, rollout = trainer.objective.first_forward_logprobs()
    assert len(first) == sum(s.num_trained_tokens for s in samples)
    assert float((first - rollout).abs().mean()) < 2e-2  # the pre-pass is the trainer's pre-update policy
    assert metrics["ref_kl_mean"] > 0 and metrics["entropy_mean"] > 0 and np.isfinite(metrics["loss"])
