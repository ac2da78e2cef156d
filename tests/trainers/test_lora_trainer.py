"""trainer.lora on the torch backend (PEFT): what trains, the reference with the adapter off, checkpoints
holding the adapter and its optimizer state, exact resume, and the exports PEFT and transformers load."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rayrl.config import AlgorithmConfig, ConfigError, LoraConfig, TrainerConfig, load_config
from rayrl.resolve import load_checked
from rayrl.rl.updates import plan_updates
from rayrl.trainers import lora
from rayrl.types import Sample


def _samples(n: int = 4, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(10, 4000, size=20).astype(np.int32)
        out.append(Sample(tokens=tokens, prompt_length=8, loss_mask=np.ones(12), policy_versions=np.zeros(12),
                          rollout_logprobs=np.full(12, -8.0, np.float32), reward=float(rng.integers(0, 2))))
    return out


ADV = [1.0, -1.0, 0.5, -0.5]


def _cfg(**lora) -> TrainerConfig:
    return TrainerConfig(lr=5e-2, compute_dtype="float32", steps=4, lora=LoraConfig(**{"rank": 4, **lora}))


def _trainer(model_dir, cfg: TrainerConfig, algo: AlgorithmConfig | None = None):
    from rayrl.trainers.torch_backend import TorchTrainer

    return TorchTrainer(model_dir, cfg, algorithm=algo, seed=0, device="cpu")


def _step(trainer, samples=None, algo=None, **plan):
    samples = samples or _samples()
    (keep, p), = plan_updates(samples, ADV, algo or trainer.algorithm, **plan)
    return trainer.train_step([samples[i] for i in keep], [ADV[i] for i in keep], p)


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


IDS = [11, 200, 3050, 42, 7, 999, 12, 13]


def test_config_names_the_field_and_megatron_refuses():
    assert not load_config(None).trainer.lora.enabled
    cfg = load_config(None, ["trainer.lora.rank=16", "trainer.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.trainer.lora.rank == 16 and cfg.trainer.lora.target_modules == ["q_proj", "v_proj"]
    for override, field in (("trainer.lora.rank=-1", "trainer.lora.rank"),
                            ("trainer.lora.alpha=0", "trainer.lora.alpha"),
                            ("trainer.lora.dropout=1.5", "trainer.lora.dropout"),
                            ("trainer.lora.target_modules=[]", "trainer.lora.target_modules")):
        with pytest.raises(ConfigError, match=f"^{field}:"):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="^trainer.lora: the megatron backend trains full weights only"):
        load_checked(None, ["trainer.lora.rank=8", "trainer.backend=megatron"])


def test_only_the_adapter_trains_and_the_reference_is_the_base_with_it_off(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    algo = AlgorithmConfig(kl_loss_coef=0.1)
    trainer = _trainer(tiny_model_dir, _cfg(), algo)
    assert trainer.reference is None and trainer.reference_is_base  # no second copy of the weights
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # every linear layer but the head has an adapter
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    frozen_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    adapter_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = _step(trainer, algo=algo)
    _step(trainer, algo=algo)
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in frozen_before.items())  # base untouched
    assert any(not torch.equal(after[n], t) for n, t in adapter_before.items())  # the adapter moved
    # AdamW holds moments for the adapter only
    state_ids = {id(p) for p in trainer.optimizer.state}
    assert state_ids == {id(after[n]) for n in trained}
    assert metrics["ref_kl_mean"] == pytest.approx(0.0, abs=1e-6)  # B starts at zero: policy == base
    # after two steps the reference still equals the untouched base model, the policy does not
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    samples = _samples()
    (keep, p), = plan_updates(samples, ADV, algo)
    batch = trainer._mini_batch([samples[i] for i in keep], ADV, p.minibatches[0])[0]
    trainer._no_grad_passes([batch], proximal=False)
    ref = batch["tokens"].ref_logp
    expected = torch.log_softmax(_logits(base, samples[0].tokens.tolist()), -1)
    first = torch.tensor([expected[8 - 1 + j, samples[0].tokens[8 + j]] for j in range(12)])
    rows = (batch["rows"] == 0).nonzero().squeeze(-1)
    order = torch.argsort(batch["cols"][rows])
    assert torch.allclose(ref[rows][order], first, atol=1e-5)
    assert not torch.allclose(trainer.token_logprobs(batch)[rows][order], first, atol=1e-3)


@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_a_step_runs_no_pass_and_no_gradient_it_does_not_need(tiny_model_dir, monkeypatch, kl):
    """The step time LoRA saves: no weight gradient for any frozen weight (the tied embedding and head
    included), and no reference pass (the base with the adapter off) unless a KL term asks for it."""
    algo = AlgorithmConfig(kl_loss_coef=kl)
    trainer = _trainer(tiny_model_dir, _cfg(), algo)
    passes, adapter_off = [], []
    lora.causal_lm(trainer.model).model.register_forward_hook(lambda *_: passes.append(torch.is_grad_enabled()))
    real_off = lora.adapter_off

    def counted_off(model):
        adapter_off.append(1)
        return real_off(model)

    monkeypatch.setattr(lora, "adapter_off", counted_off)
    _step(trainer, algo=algo)
    # one micro-batch: its training forward, and the reference forward (no grad) only with a KL term
    assert passes == ([False, True] if kl else [True]) and len(adapter_off) == (1 if kl else 0)
    for name, p in trainer.model.named_parameters():
        if not (".lora_A." in name or ".lora_B." in name):
            assert not p.requires_grad and p.grad is None, name


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo", "sft"])
def test_every_policy_loss_trains_the_adapter_with_kl_entropy_and_several_updates(tiny_model_dir, loss):
    algo = AlgorithmConfig(policy_loss=loss, kl_loss_coef=0.05, kl_reward_coef=0.02, entropy_coef=0.01,
                           sft_coef=0.1 if loss != "sft" else 0.0, tis_cap=2.0)
    trainer = _trainer(tiny_model_dir, dataclasses.replace(_cfg(), num_steps_per_rollout=2, epochs_per_rollout=2), algo)
    before = lora_state(trainer)
    metrics = _step(trainer, algo=algo, num_minibatches=2, epochs=2)
    assert metrics["optimizer_steps"] == 4 and np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert any(not torch.equal(before[n], t) for n, t in lora_state(trainer).items())


def test_under_autocast_the_adapter_input_is_not_copied_to_float32_and_back(tiny_model_dir):
    """Mixed precision (bfloat16 autocast, the GPU default): every lora_A gets its layer's input as the base
    layer gets it, not PEFT's float32 copy of a bfloat16 input (o_proj's and down_proj's are bfloat16: the
    attention output and the MLP product) that autocast would copy back to bfloat16 for the matmul; the
    log-probs are the same numbers PEFT's casting gives."""
    from peft.tuners.lora import LoraLayer

    trainer = _trainer(tiny_model_dir, dataclasses.replace(_cfg(), compute_dtype="bfloat16"))
    assert trainer.autocast_dtype == torch.bfloat16
    layers = [m for m in trainer.model.modules() if isinstance(m, LoraLayer)]
    seen: list[tuple[str, torch.dtype]] = []
    for layer in layers:
        layer.base_layer.register_forward_pre_hook(lambda _, args: seen.append(("base", args[0].dtype)))
        layer.lora_A[lora.ADAPTER].register_forward_pre_hook(lambda _, args: seen.append(("lora_A", args[0].dtype)))
    samples = _samples()
    (keep, p), = plan_updates(samples, ADV, trainer.algorithm)
    batch = trainer._mini_batch([samples[i] for i in keep], ADV, p.minibatches[0])[0]

    def pairs() -> tuple[torch.Tensor, list[tuple[torch.dtype, torch.dtype]]]:
        seen.clear()
        with torch.no_grad():
            logp = trainer.token_logprobs(batch)
        assert [kind for kind, _ in seen] == ["base", "lora_A"] * len(layers)
        return logp, [(seen[i][1], seen[i + 1][1]) for i in range(0, len(seen), 2)]

    ours, dtypes = pairs()
    assert (torch.bfloat16, torch.bfloat16) in dtypes  # bfloat16 inputs exist, and their adapter takes them as such
    assert all(base == adapter for base, adapter in dtypes), dtypes
    for layer in layers:  # PEFT's default: the input cast to the adapter's float32 first
        layer.cast_input_dtype_enabled = True
    peft_default, dtypes = pairs()
    assert (torch.bfloat16, torch.float32) in dtypes  # the copy the trainer no longer makes
    assert torch.equal(ours, peft_default)


def lora_state(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_a_named_reference_model_is_still_loaded(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, _cfg(), AlgorithmConfig(kl_loss_coef=0.1, reference_path=str(tiny_model_dir)))
    assert trainer.reference is not None and not trainer.reference_is_base


def test_gradient_checkpointing_trains_the_adapter(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, dataclasses.replace(_cfg(), gradient_checkpointing=True))
    before = lora_state(trainer)
    assert _step(trainer)["grad_norm"] > 0
    assert any(not torch.equal(before[n], t) for n, t in lora_state(trainer).items())


def test_resume_is_exact_and_the_checkpoint_holds_the_adapter_only(tiny_model_dir, tmp_path):
    cfg = _cfg(dropout=0.1)  # dropout draws from the RNG: the restored RNG state matters
    a = _trainer(tiny_model_dir, cfg)
    _step(a, _samples(seed=1))
    a.save_checkpoint(tmp_path / "ckpt")
    _step(a, _samples(seed=2))
    _step(a, _samples(seed=3))

    b = _trainer(tiny_model_dir, cfg)
    _step(b, _samples(seed=9))  # b's own state (weights, moments, RNG a step further) is overwritten by the load
    _step(b, _samples(seed=8))
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.policy_version == 1 and b.optimizer_steps == 1
    _step(b, _samples(seed=2))
    _step(b, _samples(seed=3))
    for (name, pa), (_, pb) in zip(lora_state(a).items(), lora_state(b).items()):
        assert torch.equal(pa, pb), name
    saved = torch.load(tmp_path / "ckpt" / "rank0.pt", weights_only=False)
    assert saved["lora_rank"] == 4 and set(saved["model"]) == set(lora_state(a))
    full = sum(p.numel() for p in a.model.parameters())
    assert sum(t.numel() for t in saved["model"].values()) < full / 20

    with pytest.raises(ValueError, match="^trainer.lora.rank: the checkpoint .* written with 4"):
        _trainer(tiny_model_dir, dataclasses.replace(cfg, lora=LoraConfig(rank=0))).load_checkpoint(tmp_path / "ckpt")


def test_weights_for_the_engines_and_both_exports_match_the_policy(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tiny_model_dir, _cfg())
    _step(trainer)
    _step(trainer)
    trainer.model.eval()
    want = _logits(trainer.model, IDS)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    assert not torch.allclose(_logits(base, IDS), want, atol=1e-4)  # the adapter changed the policy

    sent = dict(trainer.named_weights())  # the engines get the adapter alone, under PEFT's names
    assert sent and all(n.startswith("base_model.model.") and (".lora_A." in n or ".lora_B." in n) for n in sent)
    assert trainer.adapter_config()["r"] == 4 and set(trainer.adapter_config()["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    merged = lora.merged_weights(trainer.model)
    assert set(merged) <= set(base.state_dict()) and not any("lora" in n for n in merged)
    base.load_state_dict(merged, strict=False)
    assert torch.allclose(_logits(base, IDS), want, atol=1e-5)

    adapter_dir = trainer.export_adapter(tmp_path / "adapter")
    assert (adapter_dir / "adapter_config.json").is_file() and (adapter_dir / "adapter_model.safetensors").is_file()
    fresh = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(fresh, str(adapter_dir)).eval()
    assert torch.allclose(_logits(loaded, IDS), want, atol=1e-5)

    merged_dir = trainer.export_merged(tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    assert torch.allclose(_logits(plain, IDS), want, atol=1e-5)


def test_an_engine_backend_that_cannot_serve_adapters_is_refused_at_load(monkeypatch):
    from rayrl.engines import backends
    from rayrl.engines.backends.cpu import CPU

    monkeypatch.setitem(backends.BACKENDS, "plain", dataclasses.replace(CPU, name="plain", serves_lora=False))
    load_checked(None, ["engine.backend=plain"])  # full weights: fine
    with pytest.raises(ConfigError, match="^trainer.lora: engine.backend plain cannot serve LoRA adapters; use one of "
                                          "cpu, sglang"):
        load_checked(None, ["engine.backend=plain", "trainer.lora.rank=8"])
    assert load_checked(None, ["engine.backend=sglang", "trainer.lora.rank=8"]).trainer.lora.rank == 8
