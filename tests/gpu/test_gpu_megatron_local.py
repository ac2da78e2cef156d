"""The Megatron trainer on Megatron's local layer spec (no Transformer Engine: the lent GPU machines have none),
on one GPU: built from a HF Llama through mbridge, the HF model's log-probs, a GRPO step, mbridge's export
(QKV split per query group) loaded into transformers with equal logits, the dist_checkpointing round trip
with the optimizer's state, and offload/onload under torch_memory_saver with the memory figures.

What the CPU cannot run of this (tests/contracts/test_megatron_contract.py runs the rest there): Megatron's
attention core (its score buffer is allocated on ``torch.cuda.current_device()``), its optimizers (they
allocate on 'cuda' when built), DDP (its buffers likewise) and dist_checkpointing's save (it always calls
``torch.cuda.synchronize()``). rayrl/trainers/megatron_checkpoint.py names the lines."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from _gpu_kit import gpu_memory_used_bytes, need, record

from rayrl.config import TrainerConfig
from rayrl.ports import free_port
from rayrl.types import Sample

pytestmark = pytest.mark.gpu
VOCAB = 1024


def _llama_dir(tmp_path_factory, hidden: int, layers: int, vocab: int, name: str):
    """A Llama with grouped-query attention (2 query heads per key/value head), random weights, safetensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6, torch_dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # larger than the default init, so log-probs differ visibly from uniform
        for pname, p in model.named_parameters():
            if not pname.endswith("norm.weight"):
                p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _llama_dir(tmp_path_factory, hidden=256, layers=2, vocab=VOCAB, name="tiny-llama")


def _cfg(**overrides) -> TrainerConfig:
    base = dict(backend="megatron", megatron_layer_spec="local", sequence_packing=False, dtype="float32", lr=1e-3,
                micro_batch_tokens=256, grad_clip=1.0)
    return TrainerConfig(**{**base, **overrides})


def _trainer(path, **overrides):
    need("megatron.core", "mbridge")
    from rayrl.trainers.megatron_backend import MegatronTrainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    return MegatronTrainer(path, _cfg(**overrides), rank=0, world_size=1, seed=0, local_rank=0)


@pytest.fixture(scope="module")
def trainer(llama_dir):
    return _trainer(llama_dir)


def _samples(n: int, seed: int, vocab: int = VOCAB) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(24, 64))
        resp = length - 8
        out.append(Sample(tokens=rng.integers(3, vocab, size=length).astype(np.int32), prompt_length=8,
                          loss_mask=np.ones(resp, np.int8), rollout_logprobs=np.zeros(resp, np.float32),
                          policy_versions=np.zeros(resp, np.int32)))  # fmt: skip
    return out


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {name: t.detach().float().cpu().clone() for name, t in trainer.named_weights()}


def _max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_1_local_spec_matches_the_hf_model(trainer, llama_dir):
    from transformers import AutoModelForCausalLM

    samples = _samples(6, seed=0)
    ours = trainer.token_logprobs(samples)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).cuda().eval()
    ref = []
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(s.tokens.astype(np.int64))[None].cuda()
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
            ref.append(logp[s.prompt_length - 1 : -1].gather(1, ids[0, s.prompt_length :, None])[:, 0].cpu().numpy())
    diff = np.concatenate([np.abs(a - b) for a, b in zip(ours, ref)])
    spread = float(np.concatenate(ref).std())
    record("megatron_local_vs_hf", {"mean_abs_logprob_diff": float(diff.mean()), "dtype": "float32",
                                    "max_abs_logprob_diff": float(diff.max()), "hf_logprob_std": spread,
                                    "tokens": int(diff.size)})
    assert spread > 0.1 and diff.max() < 1e-3  # fp32 on both sides


def test_2_a_grpo_step(trainer):
    samples = _samples(4, seed=1)
    for s, lp in zip(samples, trainer.token_logprobs(samples)):
        s.rollout_logprobs = lp.astype(np.float32)  # on-policy
    before = [float(lp.sum()) for lp in trainer.token_logprobs(samples)]
    started = time.perf_counter()
    metrics = trainer.train_step(samples, [1.0, -1.0, 1.0, -1.0])
    step_s = time.perf_counter() - started
    after = [float(lp.sum()) for lp in trainer.token_logprobs(samples)]
    record("megatron_local_train_step", {**{k: v for k, v in metrics.items() if isinstance(v, (int, float, bool))},
                                         "step_s": step_s})
    assert metrics["update_successful"] and metrics["policy_version"] == 1 and metrics["micro_batches"] == 4
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and metrics["logprob_abs_diff"] < 1e-3
    assert after[0] > before[0] and after[2] > before[2] and after[1] < before[1] and after[3] < before[3]


def test_3_export_loads_into_transformers_with_equal_logits(trainer, llama_dir):
    """After training (the weights are no longer the file's): mbridge's export, strictly loaded into the
    transformers Llama, gives the Megatron model's own logits."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    exported = _weights(trainer)
    original = {}
    for f in sorted(llama_dir.glob("*.safetensors")):
        original.update(load_file(str(f)))
    assert set(exported) == set(original)
    moved = _max_abs(exported, {k: v.float() for k, v in original.items()})
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama_dir)).float()
    hf.load_state_dict(exported, strict=True)
    hf = hf.cuda().eval()
    ids = torch.from_numpy(np.random.default_rng(7).integers(3, VOCAB, size=(1, 48))).cuda()
    with torch.no_grad():
        for m in trainer.model:
            m.eval()
        ours = trainer.model[0](input_ids=ids, position_ids=torch.arange(48, device="cuda")[None],
                                attention_mask=None).float()
        theirs = hf(ids).logits.float()
    diff = float((ours - theirs).abs().max())
    record("megatron_local_export", {"max_abs_logit_diff": diff, "logit_std": float(theirs.std()),
                                     "max_weight_change_since_load": moved, "tensors": len(exported)})
    assert moved > 1e-4  # training moved the weights: the export is of the trained model
    assert diff < 1e-3 * max(1.0, float(theirs.abs().max()))


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_4_checkpoint_round_trip_restores_weights_and_adam_state(llama_dir, tmp_path, distributed_optimizer):
    """Save after a step; train on; a fresh trainer (no Adam moments yet) loads and trains the same batch to
    the same weights. A control given the weights alone (what a load without the optimizer's moments, as
    is_loading=False makes it, leaves) ends far from them, so the comparison can tell the two apart."""
    first = _trainer(llama_dir, distributed_optimizer=distributed_optimizer)
    first.train_step(_samples(4, seed=2), [1.0, -1.0, 1.0, -1.0])
    first.save_checkpoint(str(tmp_path / "ckpt"))  # as actors/trainer.py calls it (as_rank None)
    saved, saved_steps = _weights(first), first.optimizer_steps
    batch, adv = _samples(4, seed=3), [1.0, -1.0, 0.5, -0.5]
    first.train_step(batch, adv)
    trained_on = _weights(first)

    fresh = _trainer(llama_dir, distributed_optimizer=distributed_optimizer)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert fresh.policy_version == 1 and fresh.optimizer_steps == saved_steps
    assert _max_abs(_weights(fresh), saved) == 0.0
    fresh.train_step(batch, adv)
    resumed_gap = _max_abs(_weights(fresh), trained_on)

    control = _trainer(llama_dir, distributed_optimizer=distributed_optimizer)
    control.load_checkpoint(str(tmp_path / "ckpt"))
    for opt in getattr(control.optimizer, "chained_optimizers", [control.optimizer]):
        opt.optimizer.state.clear()  # Adam's moments gone, as after a load that did not bring them back
    control.train_step(batch, adv)
    control_gap = _max_abs(_weights(control), trained_on)
    step = _max_abs(trained_on, saved)
    record(f"megatron_local_checkpoint_{'distopt' if distributed_optimizer else 'plain'}",
           {"resumed_vs_uninterrupted_max_abs": resumed_gap, "without_moments_vs_uninterrupted_max_abs": control_gap,
            "step_max_abs": step, "files": sorted(p.name for p in (tmp_path / "ckpt").iterdir())})
    assert control_gap > 0.1 * step  # the comparison sees missing moments
    assert resumed_gap <= 1e-2 * step, (resumed_gap, step)


def test_5_offload_and_onload_under_torch_memory_saver(tmp_path_factory):
    need("torch_memory_saver")
    path = _llama_dir(tmp_path_factory, hidden=1024, layers=4, vocab=32000, name="medium-llama")
    trainer = _trainer(path, dtype="bfloat16", memory_saver=True)
    assert trainer.memory.active
    trainer.train_step(_samples(4, seed=4, vocab=32000), [1.0, -1.0, 1.0, -1.0])
    params = sum(p.numel() for m in trainer.model for p in m.parameters())
    kept = _weights(trainer)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cycles = []
    for _ in range(2):
        used = gpu_memory_used_bytes()
        started = time.perf_counter()
        assert trainer.offload()
        offload_s = time.perf_counter() - started
        freed = used - gpu_memory_used_bytes()
        started = time.perf_counter()
        assert trainer.onload()
        cycles.append({"freed_bytes": freed, "offload_s": offload_s, "onload_s": time.perf_counter() - started,
                       "regained_bytes": gpu_memory_used_bytes() - (used - freed)})
    restored = _max_abs(_weights(trainer), kept)
    metrics = trainer.train_step(_samples(4, seed=5, vocab=32000), [1.0, -1.0, 1.0, -1.0])
    record("megatron_local_offload", {"parameters": params, "cycles": cycles,
                                      "bytes_per_parameter_freed": cycles[0]["freed_bytes"] / params,
                                      "restored_max_abs": restored,
                                      "step_after_onload_ok": bool(metrics["update_successful"])})
    # bf16 params (2 B) + fp32 grads (4 B) + fp32 main params and Adam's two moments (12 B): at least the
    # params and grads must have left
    assert all(c["freed_bytes"] >= 6 * params for c in cycles)
    assert restored == 0.0 and metrics["update_successful"]
