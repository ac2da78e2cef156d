"""The CPU stand-in for torch_memory_saver's pause (rayrl/trainers/memory_standin.py): after offload the
weights cannot be read, as on a GPU where their memory is unmapped; onload gives them back bit for bit."""

from __future__ import annotations

import pytest
import torch

from rayrl.config import ConfigError, TrainerConfig
from rayrl.trainers.memory_standin import UnmappedStandIn
from rayrl.trainers.torch_backend import TorchTrainer


def test_offloaded_weights_are_unreadable_until_onload(tiny_model_dir):
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(memory_saver_standin=True), device="cpu")
    assert isinstance(trainer.memory, UnmappedStandIn)
    before = {n: t.clone() for n, t in trainer.named_weights(torch.float32)}
    assert trainer.offload() is True
    with pytest.raises(NotImplementedError):  # what a weight push after offload does: read the values
        {n: t.to("cpu") for n, t in trainer.named_weights(torch.float32)}
    assert trainer.onload() is True
    after = dict(trainer.named_weights(torch.float32))
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert trainer.offload() and trainer.offload() is False  # a second pause is a no-op, as the saver's


def test_the_standin_is_for_the_torch_backend_only():
    with pytest.raises(ConfigError, match="trainer.memory_saver_standin"):
        TrainerConfig(backend="megatron", memory_saver_standin=True)


def test_training_goes_on_after_an_offload_cycle(tiny_model_dir):
    import numpy as np

    from rayrl.types import Sample

    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(memory_saver_standin=True, micro_batch_tokens=256),
                           device="cpu")
    tokens = np.arange(10, 30, dtype=np.int32)
    sample = Sample(tokens=tokens, prompt_length=6, loss_mask=np.ones(14, np.int8),
                    rollout_logprobs=np.full(14, -5.0, np.float32), policy_versions=np.zeros(14, np.int32))
    trainer.train_step([sample], [1.0])
    trainer.offload()
    trainer.onload()
    assert np.isfinite(trainer.train_step([sample], [1.0])["loss"])
