"""The Megatron backend's data layout, on CPU: packed sequences put every trained token where the torch
backend puts it (same log-probs from the same model), shards and micro-batches cover the batch once,
and asking for the backend without its packages fails with a message naming them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayrl.config import AlgorithmConfig, TrainerConfig
from rayrl.rl.objective import STATS, Objective
from rayrl.rl.shard import shard_batch
from rayrl.rl.updates import MiniBatch, UpdatePlan
from rayrl.trainers import megatron_backend as mb
from rayrl.trainers import megatron_packing as mp
from rayrl.types import Sample


def _sample(rng: np.random.Generator, length: int, prompt: int) -> Sample:
    n = length - prompt
    mask = (rng.random(n) > 0.3).astype(np.int8)
    return Sample(tokens=rng.integers(10, 4000, size=length).astype(np.int32), prompt_length=prompt,
                  loss_mask=mask, rollout_logprobs=rng.normal(size=n).astype(np.float32),
                  policy_versions=rng.integers(0, 3, size=n).astype(np.int32))  # fmt: skip


def test_packed_positions_match_the_torch_backend(tiny_model_dir):
    from rayrl.trainers.torch_backend import TorchTrainer

    rng = np.random.default_rng(0)
    samples = [_sample(rng, 19, 5), _sample(rng, 11, 3), _sample(rng, 24, 9)]
    advantages = [0.5, -1.0, 2.0]
    fields = Objective(AlgorithmConfig()).token_fields(samples, advantages, UpdatePlan.single(samples).minibatches[0])
    batch = mp.pack_samples(samples, fields, align=4)
    seg = [20, 12, 24]  # each padded to a multiple of 4
    assert batch.cu_seqlens.tolist() == [0, 20, 32, 56] and batch.max_seqlen == 24
    assert batch.position_ids[0, 20:32].tolist() == list(range(12))
    assert int(batch.loss_mask.sum()) == sum(int(s.loss_mask.sum()) for s in samples)

    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(compute_dtype="float32"), seed=0, device="cpu")
    expected = trainer.token_logprobs(trainer._micro_batch(samples, advantages)).detach()
    # the same model run segment by segment over the packed layout
    logps, start = [], 0
    with torch.no_grad():
        for length in seg:
            ids = batch.tokens[:, start : start + length]
            logits = trainer.model(ids).logits[0].float()
            lp = torch.log_softmax(logits, -1).gather(1, batch.targets[0, start : start + length, None])[:, 0]
            logps.append(lp)
            start += length
    packed = torch.cat(logps)[batch.loss_mask[0].bool()]
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    keep = batch.loss_mask[0].bool()
    want_rollout = np.concatenate([s.rollout_logprobs[s.loss_mask == 1] for s in samples])
    assert np.allclose(batch.fields["rollout_logp"][0, keep].numpy(), want_rollout)
    want_adv = np.concatenate([np.full(int(s.loss_mask.sum()), a) for s, a in zip(samples, advantages)])
    assert np.allclose(batch.fields["advantages"][0, keep].numpy(), want_adv)


def test_shards_and_micro_batches_cover_the_batch_once():
    lengths = [50, 10, 300, 40, 40, 120, 7]
    shards = shard_batch(lengths, 3)
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)
    groups = mp.micro_batches_by_tokens(lengths, 128)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    assert all(len(g) == 1 or sum(lengths[i] for i in g) <= 128 for g in groups)
    empty = mp.empty_batch(8)
    assert int(empty.loss_mask.sum()) == 0 and empty.tokens.shape == (1, 8)


def test_missing_packages_are_named():
    try:
        mb.require_megatron()
    except mb.MegatronUnavailable as err:
        assert "trainer.backend" in str(err)
        if not torch.cuda.is_available():  # whichever pieces this machine lacks are named (megatron-core may be here)
            assert any(piece in str(err) for piece in ("megatron-core", "mbridge", "transformer-engine", "CUDA"))
    else:
        pytest.skip("megatron-core, mbridge, Transformer Engine and CUDA are all here")


# -- the same loss from both backends' paths ----------------------------------------------------------

ALGORITHMS = {
    "grpo-ppo_clip": AlgorithmConfig(),
    "gspo": AlgorithmConfig(policy_loss="gspo", clip_eps=0.05, clip_eps_high=0.05),
    "cispo+dr_grpo-norm+kl+entropy": AlgorithmConfig(policy_loss="cispo", advantage_estimator="dr_grpo",
                                                    loss_agg_norm=64, kl_loss_coef=0.1, entropy_coef=0.01),
    "dual_clip+seq_sum+tis+kl_reward+sft": AlgorithmConfig(dual_clip_c=3.0, loss_agg="seq_mean_token_sum", tis_cap=2.0,
                                                          kl_reward_coef=0.2, sft_coef=0.3),
}


def _packed_logits(model: torch.nn.Module, batch: mp.PackedBatch) -> torch.Tensor:
    """What Megatron's packed THD forward gives: each segment attends only to itself."""
    bounds = batch.cu_seqlens.tolist()
    parts = [model(batch.tokens[:, a:b]).logits for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts, dim=1).float()


def _torch_logp_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from rayrl.rl.policy_losses import entropy_from_logits

    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    return logp, entropy_from_logits(logits)


@pytest.fixture(scope="module")
def megatron_state():
    """megatron-core's parallel state for one CPU process (gloo), where megatron-core imports; else None
    (then the packed path's log-probs come from torch, the formula Megatron's vocab-parallel kernel has)."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu
    except ImportError:
        yield None
        return
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", rank=0, world_size=1)
    mpu.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    yield mpu
    mpu.destroy_model_parallel()
    if owned:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_both_backends_give_the_same_loss_and_gradient(tiny_model_dir, megatron_state, name):
    """The torch backend's micro-batch and the Megatron backend's packed micro-batch, same samples, same
    model, same loss helper: the same loss, statistics and gradient, with a global mini-batch twice this
    one (the normalisers come from the plan, not the local batch) and Megatron's division by the summed
    token count undone as Megatron does it."""
    from rayrl.trainers.torch_backend import TorchTrainer

    algo = ALGORITHMS[name]
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(compute_dtype="float32", share_prefix=False), algorithm=algo,
                           seed=0, device="cpu")
    rng = np.random.default_rng(1)
    samples = [_sample(rng, 19, 5), _sample(rng, 11, 3), _sample(rng, 24, 9)]
    for s, r in zip(samples, (1.0, 0.0, 1.0)):
        s.reward = r
        s.rollout_logprobs[:] = rng.normal(-10.8, 0.3, size=len(s.rollout_logprobs))  # near the model's own
    advantages = [0.5, -1.0, 2.0]
    local = sum(s.num_trained_tokens for s in samples)
    minibatch = MiniBatch((0, 1, 2), tokens=2 * local, sequences=6)
    objective = trainer.objective
    ref = torch.from_numpy(rng.normal(-10.8, 0.3, size=local).astype(np.float32))

    batch = trainer._micro_batch(samples, advantages, minibatch)
    batch["tokens"].ref_logp = ref
    logp, entropy = trainer.token_logprobs(batch, with_entropy=True)
    loss_t, stats_t = objective.loss(batch["tokens"], logp, entropy if objective.uses_entropy else None)
    trainer.model.zero_grad()
    loss_t.backward()
    grads_t = [p.grad.clone() for p in trainer.model.parameters()]

    packed = mp.pack_samples(samples, objective.token_fields(samples, advantages, minibatch), align=4)
    packed.ref_logp = ref
    trainer.model.zero_grad()
    logits = _packed_logits(trainer.model, packed)
    if megatron_state is not None:  # Megatron's own vocab-parallel cross entropy and our sharded entropy
        logp_all, entropy_all = mb.logp_and_entropy(logits, packed.targets, entropy=True)
    else:
        logp_all, entropy_all = _torch_logp_entropy(logits, packed.targets)
    loss_m, num_tokens, out = mp.packed_loss(objective, packed, logp_all, minibatch.tokens,
                                             entropy_all if objective.uses_entropy else None)
    assert int(num_tokens) == local
    (loss_m / minibatch.tokens).backward()  # Megatron divides by the tokens summed over ranks: the mini-batch's
    torch.testing.assert_close(loss_m.detach() / minibatch.tokens, loss_t.detach(), atol=1e-5, rtol=1e-5)
    expected = torch.stack([stats_t[k] for k in STATS])
    torch.testing.assert_close(out["stats"], expected, atol=1e-4, rtol=1e-5)
    for g_t, p in zip(grads_t, trainer.model.parameters()):
        torch.testing.assert_close(p.grad, g_t, atol=1e-5, rtol=1e-4)
