"""Torch trainer: a GRPO step moves log-probs the right way, and after a weight sync the engine's
outputs and log-probs match the trainer's weights exactly (same model, same numbers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayrl.config import LoraConfig, TrainerConfig
from rayrl.engines.cpu.engine import CPUEngine
from rayrl.trainers.torch_backend import TorchTrainer, autocast_dtype, pack_micro_batches, shared_prefix_length
from rayrl.types import Sample
from rayrl.weights.files import write_weights


def _sample(tokens: np.ndarray, prompt_len: int, trainer: TorchTrainer) -> Sample:
    """An on-policy sample: rollout log-probs computed by the trainer's own model."""
    n = len(tokens) - prompt_len
    with torch.no_grad():
        logits = trainer.model(torch.from_numpy(tokens[None].astype(np.int64))).logits[0].float()
        lp = torch.log_softmax(logits, -1)[prompt_len - 1 : -1].gather(
            -1, torch.from_numpy(tokens[prompt_len:].astype(np.int64))[:, None]
        )[:, 0]
    return Sample(tokens=tokens, prompt_length=prompt_len, loss_mask=np.ones(n, np.int8),
                  rollout_logprobs=lp.numpy(), policy_versions=np.zeros(n, np.int32))


def _seq_logprob(trainer: TorchTrainer, s: Sample) -> float:
    with torch.no_grad():
        logits = trainer.model(torch.from_numpy(s.tokens[None].astype(np.int64))).logits[0].float()
        lp = torch.log_softmax(logits, -1)[s.prompt_length - 1 : -1]
        return float(lp.gather(-1, torch.from_numpy(s.tokens[s.prompt_length:].astype(np.int64))[:, None]).sum())


def test_pack_micro_batches_respects_budget():
    groups = pack_micro_batches([10, 300, 20, 200, 50, 700], max_tokens=400)
    assert sorted(i for g in groups for i in g) == list(range(6))
    lengths = [10, 300, 20, 200, 50, 700]
    for g in groups:
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 400


def test_grpo_step_then_engine_matches_trainer(tiny_model_dir, tmp_path):
    cfg = TrainerConfig(lr=5e-3, micro_batch_tokens=64, grad_clip=1.0, compute_dtype="float32")  # exact numbers
    trainer = TorchTrainer(tiny_model_dir, cfg, seed=0, device="cpu")
    rng = np.random.default_rng(0)
    samples = [_sample(rng.integers(10, 4000, size=24).astype(np.int32), 8, trainer) for _ in range(4)]
    samples[1].loss_mask[:5] = 0  # masked tokens (tool output) must not count
    before = [_seq_logprob(trainer, s) for s in samples]
    metrics = trainer.train_step(samples, [1.0, -1.0, 1.0, -1.0])
    assert metrics["policy_version"] == 1 and metrics["trained_samples"] == 4
    assert metrics["trained_tokens"] == 4 * 16 - 5
    assert metrics["grad_norm"] > 0 and np.isfinite(metrics["loss"])
    assert metrics["logprob_abs_diff"] < 1e-4  # on-policy: the trainer agrees with the rollout log-probs
    after = [_seq_logprob(trainer, s) for s in samples]
    assert after[0] > before[0] and after[2] > before[2]  # positive advantage: more likely
    assert after[1] < before[1] and after[3] < before[3]  # negative advantage: less likely

    # zero-advantage samples are skipped without a forward pass
    skipped = trainer.train_step(samples, [0.0, 0.0, 0.0, 0.0])
    assert skipped["trained_samples"] == 0 and skipped["policy_version"] == 2

    engine = CPUEngine(tiny_model_dir, dtype="float32", max_batch_size=4).start()
    try:
        prompt = samples[0].tokens[:8].tolist()
        greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        stale = engine.generate(prompt, greedy)
        path = write_weights(dict(trainer.named_weights(torch.float32)), tmp_path / "weights", version=2)
        engine.load_weights_from_disk(path, "2")
        fresh = engine.generate(prompt, greedy)
        assert fresh.weight_version == "2"
        trainer.model.eval()
        with torch.no_grad():
            expect = trainer.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                            min_new_tokens=12, pad_token_id=0)[0, 8:].tolist()
        assert fresh.output_ids == expect
        full = np.array(prompt + fresh.output_ids, dtype=np.int32)
        with torch.no_grad():
            logits = trainer.model(torch.from_numpy(full[None].astype(np.int64))).logits[0].float()
            lp = torch.log_softmax(logits, -1)[7:-1].gather(-1, torch.tensor(fresh.output_ids)[:, None])[:, 0]
        assert np.allclose(fresh.output_logprobs, lp.numpy(), atol=1e-4)
        assert stale.output_ids != fresh.output_ids or not np.allclose(stale.output_logprobs, fresh.output_logprobs)
    finally:
        engine.shutdown()


def test_bf16_compute_keeps_fp32_master_weights_and_learns(tiny_model_dir):
    """Mixed precision: autocast bf16 for forward/backward, float32 parameters and optimizer state;
    the step still agrees with float32 log-probs to bf16 precision and moves them the right way."""
    cfg = TrainerConfig(lr=5e-3, micro_batch_tokens=64, compute_dtype="bfloat16")
    trainer = TorchTrainer(tiny_model_dir, cfg, seed=0, device="cpu")
    assert trainer.autocast_dtype is torch.bfloat16
    rng = np.random.default_rng(0)
    samples = [_sample(rng.integers(10, 4000, size=24).astype(np.int32), 8, trainer) for _ in range(2)]
    before = [_seq_logprob(trainer, s) for s in samples]
    metrics = trainer.train_step(samples, [1.0, -1.0])
    assert 0 < metrics["logprob_abs_diff"] < 0.05  # bf16 rounding, not a different model
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(v.dtype == torch.float32 for st in trainer.optimizer.state.values() for v in st.values() if v.dim())
    after = [_seq_logprob(trainer, s) for s in samples]
    assert after[0] > before[0] and after[1] < before[1]


def test_compute_dtype_resolution():
    from rayrl.machine import cpu_has_native_bf16

    cpu = torch.device("cpu")
    assert autocast_dtype("float32", cpu) is None
    assert autocast_dtype("bfloat16", cpu) is torch.bfloat16
    assert autocast_dtype("auto", torch.device("cuda")) is torch.bfloat16
    native = cpu_has_native_bf16()  # AVX512-BF16 or AMX on x86 (not oneDNN's "any AVX512")
    assert autocast_dtype("auto", cpu) is (torch.bfloat16 if native else None)


def test_checkpoint_round_trip(tiny_model_dir, tmp_path):
    cfg = TrainerConfig(lr=1e-3)
    a = TorchTrainer(tiny_model_dir, cfg, seed=0, device="cpu")
    rng = np.random.default_rng(1)
    s = _sample(rng.integers(10, 4000, size=16).astype(np.int32), 4, a)
    a.train_step([s, s], [1.0, -0.5])
    a.save_checkpoint(tmp_path / "ckpt")
    b = TorchTrainer(tiny_model_dir, cfg, seed=123, device="cpu")
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.policy_version == 1
    for (na, pa), (nb, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    a.train_step([s], [1.0])
    b.train_step([s], [1.0])
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.allclose(pa, pb, atol=1e-7)  # optimizer state restored too


def test_write_weights_keeps_the_version_just_written(tmp_path):
    state = {"w": torch.ones(2)}
    write_weights(state, tmp_path, version=5)
    kept = write_weights(state, tmp_path, version=3)  # e.g. after resuming an older checkpoint
    assert kept.name == "v000003" and (kept / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.glob("v*")] == ["v000003"]


def test_shared_prefix_length_rules():
    def s(tokens, prompt_len, first_trained=0):
        tokens = np.array(tokens, dtype=np.int32)
        mask = np.zeros(len(tokens) - prompt_len, np.int8)
        mask[first_trained:] = 1
        return Sample(tokens=tokens, prompt_length=prompt_len, loss_mask=mask,
                      rollout_logprobs=np.zeros(len(mask), np.float32), policy_versions=np.zeros(len(mask), np.int32))

    common = list(range(100, 140))
    assert shared_prefix_length([s(common + [1, 2, 3], 41), s(common + [5, 6], 41)]) == 40
    assert shared_prefix_length([s(common + [1, 2, 3], 41)]) == 0  # one sample: nothing to share
    assert shared_prefix_length([s(common[:10] + [1], 5), s(common[:10] + [2], 5)]) == 0  # too short to pay
    # a trained token at response position 0 is predicted from position prompt_length - 1: not shared
    assert shared_prefix_length([s(common + [1, 2], 30), s(common + [3], 30)]) == 29
    # masked-out response tokens (tool output) before the first trained one may be shared
    assert shared_prefix_length([s(common + [1, 2], 30, first_trained=5), s(common + [3], 30, first_trained=5)]) == 34
    # identical samples still keep a token of their own
    assert shared_prefix_length([s(common, 39), s(common, 39)]) == 38


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_shared_prefix_gives_the_same_logprobs_and_gradients(tiny_model_dir, lora_rank):
    """Running the common prefix once and joining its keys/values to each sample's is exact: same log-probs,
    same update, for samples of different lengths (right padding) in one micro-batch; and so is recomputing
    every layer in the backward pass (trainer.gradient_checkpointing), which keeps the shared prefix."""
    rng = np.random.default_rng(1)
    prefix = rng.integers(10, 4000, size=48).astype(np.int32)
    tails = [rng.integers(10, 4000, size=n).astype(np.int32) for n in (20, 9, 15)]
    results = []
    for share, checkpointing in ((False, False), (True, False), (True, True)):
        cfg = TrainerConfig(lr=5e-3, micro_batch_tokens=4096, compute_dtype="float32", share_prefix=share,
                            gradient_checkpointing=checkpointing, lora=LoraConfig(rank=lora_rank))
        trainer = TorchTrainer(tiny_model_dir, cfg, seed=0, device="cpu")
        if lora_rank:  # B starts at zero: give the adapter a value so every gradient is non-zero
            with torch.no_grad():
                for p in trainer.model.parameters():
                    if p.requires_grad:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        samples = [_sample(np.concatenate([prefix, t[:4], t]), 52, trainer) for t in tails]
        samples[0].loss_mask[:3] = 0
        batch = trainer._micro_batch(samples, [1.0, -1.0, 0.5])
        assert int(batch["prefix"]) == (48 if share else 0)
        logp = trainer.token_logprobs(batch)
        (logp * batch["tokens"].advantages).sum().backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in trainer.model.named_parameters()}
        trainer.optimizer.zero_grad(set_to_none=True)
        metrics = trainer.train_step(samples, [1.0, -1.0, 0.5])
        results.append((logp.detach(), metrics, grads))
    (lp_plain, m_plain, g_plain), *others = results
    for lp_shared, m_shared, g_shared in others:
        assert torch.allclose(lp_plain, lp_shared, atol=1e-5)
        assert abs(m_plain["grad_norm"] - m_shared["grad_norm"]) < 1e-4 * max(1.0, m_plain["grad_norm"])
        assert m_plain["trained_tokens"] == m_shared["trained_tokens"] == 20 + 9 + 15 - 3
        for name, g in g_plain.items():  # the prefix's weights get the sum of what every sample sends back
            if g is None:
                assert g_shared[name] is None, name
                continue
            assert torch.allclose(g, g_shared[name], atol=1e-5, rtol=1e-4), name
            assert g.abs().max() > 0, name
