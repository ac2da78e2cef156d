"""The Megatron backend's data layout, on CPU: packed sequences put every trained token where the torch
backend puts it (same log-probs from the same model), shards and micro-batches cover the batch once,
and asking for the backend without its packages fails with a message naming them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayrl.config import AlgorithmConfig, TrainerConfig
from rayrl.rl.updates import UpdatePlan
from rayrl.rl.shard import shard_batch
from rayrl.trainers import megatron_backend as mb
from rayrl.trainers import megatron_packing as mp
from rayrl.trainers.objective import Objective
from rayrl.types import Sample


def _sample(rng: np.random.Generator, length: int, prompt: int) -> Sample:
    n = length - prompt
    mask = (rng.random(n) > 0.3).astype(np.int8)
    return Sample(tokens=rng.integers(10, 4000, size=length).astype(np.int32), prompt_length=prompt,
                  loss_mask=mask, rollout_logprobs=rng.normal(size=n).astype(np.float32),
                  policy_versions=np.zeros(n, np.int32))  # fmt: skip


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
    assert batch.num_tokens == sum(int(s.loss_mask.sum()) for s in samples)

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
    assert empty.num_tokens == 0 and empty.tokens.shape == (1, 8)


def test_missing_packages_are_named():
    try:
        mb.require_megatron()
    except mb.MegatronUnavailable as err:
        assert "trainer.backend" in str(err)
        if not torch.cuda.is_available():
            assert "megatron-core" in str(err) or "CUDA" in str(err)
    else:
        pytest.skip("megatron-core, mbridge, Transformer Engine and CUDA are all here")
