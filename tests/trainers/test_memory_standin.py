"""The CPU stand-in for torch_memory_saver's pause (rayrl/trainers/memory_standin.py): after offload the
weights cannot be read, as on a GPU where their memory is unmapped; onload gives them back bit for bit."""

from __future__ import annotations

import pytest
import torch

from rayrl.config import ConfigError, RunConfig, TrainerConfig
from rayrl.resolve import check
from rayrl.trainers.memory_standin import OffloadedMemoryError, UnmappedStandIn
from rayrl.trainers.torch_backend import TorchTrainer


def test_offloaded_weights_are_unreadable_until_onload(tiny_model_dir):
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(memory_saver_standin=True), device="cpu")
    assert isinstance(trainer.memory, UnmappedStandIn)
    before = {n: t.clone() for n, t in trainer.named_weights(torch.float32)}
    assert trainer.offload() is True
    with pytest.raises(OffloadedMemoryError):  # what a weight push after offload does: read the values
        {n: t.to("cpu") for n, t in trainer.named_weights(torch.float32)}
    assert trainer.onload() is True
    after = dict(trainer.named_weights(torch.float32))
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert trainer.offload() and trainer.offload() is False  # a second pause is a no-op, as the saver's


def test_the_standin_is_for_the_torch_backend_only():
    with pytest.raises(ConfigError, match="trainer.memory_saver_standin"):
        check(RunConfig(trainer=TrainerConfig(backend="megatron", memory_saver_standin=True)))


def test_training_goes_on_after_an_offload_cycle(tiny_model_dir):
    import numpy as np

    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(memory_saver_standin=True, micro_batch_tokens=256),
                           device="cpu")
    sample = _sample()
    trainer.train_step([sample], [1.0])
    trainer.offload()
    trainer.onload()
    assert np.isfinite(trainer.train_step([sample], [1.0])["loss"])


def _sample():
    import numpy as np

    from rayrl.types import Sample

    tokens = np.arange(10, 30, dtype=np.int32)
    return Sample(tokens=tokens, prompt_length=6, loss_mask=np.ones(14, np.int8),
                  rollout_logprobs=np.full(14, -5.0, np.float32), policy_versions=np.zeros(14, np.int32))


def test_every_read_or_write_of_offloaded_trainer_memory_raises(tiny_model_dir, tmp_path):
    """Issue 41 (C, D, E): a checkpoint save, a checkpoint load and an export of an offloaded trainer each
    raise, as they read or write unmapped memory on a GPU (the old stand-in saved meta tensors silently, and
    a load into it was undone at onload); the optimizer's moments are unmapped with the weights."""
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(memory_saver_standin=True, micro_batch_tokens=256),
                           device="cpu")
    trainer.train_step([_sample()], [1.0])
    trainer.save_checkpoint(tmp_path / "live")
    trainer.offload()
    with pytest.raises(OffloadedMemoryError):
        trainer.save_checkpoint(tmp_path / "offloaded")
    assert not (tmp_path / "offloaded" / "rank0.pt").exists()
    with pytest.raises(RuntimeError, match="on trainer memory that is offloaded"):  # load_state_dict wraps it
        trainer.load_checkpoint(tmp_path / "live")
    with pytest.raises(OffloadedMemoryError):
        next(iter(trainer.named_weights(torch.bfloat16)))
    moments = [v for s in trainer.optimizer.state.values() for k, v in s.items() if k == "exp_avg"]
    with pytest.raises(OffloadedMemoryError):
        moments[0].sum()
    trainer.onload()
    trainer.load_checkpoint(tmp_path / "live")  # onloaded, the same calls work
    trainer.save_checkpoint(tmp_path / "again")
    assert dict(trainer.named_weights()).keys()
