"""The shared prefix as a read-only cache, and the trainer's own per-layer checkpointing that keeps it
(rayrl/trainers/prefix_cache.py). Exactness against the plain forward is
tests/trainers/test_trainer_weight_sync.py::test_shared_prefix_gives_the_same_logprobs_and_gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayrl.config import LoraConfig, TrainerConfig
from rayrl.trainers import prefix_cache
from rayrl.types import Sample


def _samples(n: int = 4) -> list[Sample]:
    rng = np.random.default_rng(0)
    shared = rng.integers(10, 4000, size=40)
    return [Sample(tokens=np.concatenate([shared, rng.integers(10, 4000, size=24)]).astype(np.int32),
                   prompt_length=44, loss_mask=np.ones(20), policy_versions=np.zeros(20),
                   rollout_logprobs=np.full(20, -8.0, np.float32)) for _ in range(n)]


def _trainer(model_dir, checkpointing: bool, rank: int = 4):
    from rayrl.trainers.torch_backend import TorchTrainer

    cfg = TrainerConfig(compute_dtype="float32", gradient_checkpointing=checkpointing, lora=LoraConfig(rank=rank))
    return TorchTrainer(model_dir, cfg, seed=0, device="cpu")


def _saved_bytes(trainer, batch) -> int:
    """Bytes of the distinct tensors autograd's saved-tensor hooks see from the decoder's training forward
    (weights excluded; a checkpointed layer's own input is kept by the checkpoint, not counted here)."""
    from rayrl.trainers import lora

    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = trainer._hidden_states(lora.causal_lm(trainer.model), batch, trainer.prefix_read_only)
    hidden.sum().backward()
    return sum(seen.values())


@pytest.mark.parametrize("rank", [0, 4])
def test_checkpointing_keeps_the_shared_prefix_and_far_fewer_activations(tiny_model_dir, rank):
    plain, checkpointed = _trainer(tiny_model_dir, False, rank), _trainer(tiny_model_dir, True, rank)
    layers = prefix_cache.decoder_layers(checkpointed.model)
    assert layers and all("forward" in vars(layer) for layer in layers)
    assert not any("forward" in vars(layer) for layer in prefix_cache.decoder_layers(plain.model))
    batches = [t._micro_batch(_samples(), [1.0, -1.0, 0.5, -0.5]) for t in (plain, checkpointed)]
    assert int(batches[0]["prefix"]) == int(batches[1]["prefix"]) == 40
    kept, kept_checkpointed = _saved_bytes(plain, batches[0]), _saved_bytes(checkpointed, batches[1])
    assert kept_checkpointed < kept / 2, (kept_checkpointed, kept)


def test_the_prefix_cache_stores_nothing_and_joins_the_prefix_for_every_sample():
    from transformers.cache_utils import DynamicCache

    grown = DynamicCache()
    keys, values = torch.randn(1, 2, 5, 3), torch.randn(1, 2, 5, 3)
    grown.update(keys, values, 0)
    shared = prefix_cache.read_only_prefix(grown)
    new_k, new_v = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3)
    for _ in range(2):  # a layer run twice (checkpointing) sees the same keys both times
        k, v = shared.update(new_k, new_v, 0)
        assert k.shape == (4, 2, 8, 3) and torch.equal(k[2, :, :5], keys[0]) and torch.equal(k[2, :, 5:], new_k[2])
        assert torch.equal(v[3, :, :5], values[0]) and torch.equal(v[3, :, 5:], new_v[3])
        assert shared.get_seq_length() == 5 and shared.layers[0].keys.shape == (1, 2, 5, 3)


def test_a_sliding_window_cache_is_not_made_read_only():
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    sliding = DynamicCache()
    sliding.layers = [DynamicSlidingWindowLayer(sliding_window=4)]
    sliding.update(torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3), 0)
    assert prefix_cache.read_only_prefix(sliding) is None
