"""The torch trainer's offload logic on CPU: everything offload must free (parameters, gradients, Adam's
moments, including state a step or a checkpoint load would create) is allocated inside the memory
saver's region, and keeping it there changes no number of the training.

torch_memory_saver cannot run without CUDA, so :class:`RecordingSaverFake` STANDS IN for its region: it
records every tensor storage allocated while its region is open (the outputs of every op, through a
TorchDispatchMode) and counts pause/resume calls; it frees nothing. The membership checks and the
adoption of loaded optimizer state are MemorySaver's own code, run against the fake's record. The GPU
side (freed bytes measured with ``torch.cuda.mem_get_info``) is tests/gpu/test_gpu_offload.py.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rayrl.config import TrainerConfig
from rayrl.trainers.memory_saver import MemorySaver, _Intervals
from rayrl.trainers.torch_backend import TorchTrainer
from rayrl.types import Sample


class _StorageRecorder(TorchDispatchMode):
    def __init__(self, kept: dict[int, Any]) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                self.kept[storage.data_ptr()] = storage  # held: its address cannot be reused by others
        return out


class RecordingSaverFake(MemorySaver):
    """A fake of torch_memory_saver's region (which needs CUDA): records what is allocated inside it."""

    def __init__(self) -> None:
        super().__init__(enabled=False)
        self.device_type = "cpu"
        self.storages: dict[int, Any] = {}
        self.pauses = self.resumes = 0

    @property
    def active(self) -> bool:
        return True

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        with _StorageRecorder(self.storages):
            yield

    def _region_index(self) -> _Intervals:
        return _Intervals(sorted((ptr, s.nbytes()) for ptr, s in self.storages.items()))

    def pause(self) -> bool:
        self.pauses += 1
        return True

    def resume(self) -> bool:
        self.resumes += 1
        return True


def _state_tensors(trainer: TorchTrainer) -> list[torch.Tensor]:
    return [v for st in trainer.optimizer.state.values() for k, v in st.items() if k != "step"]


def _held(trainer: TorchTrainer) -> dict[str, list[torch.Tensor]]:
    params = list(trainer.model.parameters())
    return {"params": params, "grads": [p.grad for p in params], "adam": _state_tensors(trainer)}


def _samples(n: int, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(10, 4000, size=24).astype(np.int32)
        out.append(Sample(tokens=tokens, prompt_length=8, loss_mask=np.ones(16, np.int8),
                          rollout_logprobs=np.full(16, -8.0, np.float32), policy_versions=np.zeros(16, np.int32)))
    return out


CFG = TrainerConfig(lr=5e-3, micro_batch_tokens=64, grad_clip=1.0, compute_dtype="float32")


def test_params_grads_and_adam_state_live_in_the_region_from_the_start(tiny_model_dir):
    saver = RecordingSaverFake()
    trainer = TorchTrainer(tiny_model_dir, CFG, seed=0, device="cpu", memory=saver)
    held = _held(trainer)
    assert all(g is not None for g in held["grads"])
    assert len(held["adam"]) == 2 * len(held["params"])  # exp_avg + exp_avg_sq per parameter, before any step
    expected = {name: sum(t.nbytes for t in ts) for name, ts in held.items()}
    assert expected["grads"] == expected["params"] and expected["adam"] == 2 * expected["params"]
    assert {name: saver.bytes_outside(ts) for name, ts in held.items()} == {"params": 0, "grads": 0, "adam": 0}
    where = {name: [t.data_ptr() for t in ts] for name, ts in held.items()}
    for step in range(2):
        trainer.train_step(_samples(4, seed=step), [1.0, -1.0, 0.5, -0.5])
        now = _held(trainer)
        assert {name: [t.data_ptr() for t in ts] for name, ts in now.items()} == where  # never reallocated
        assert sum(saver.bytes_outside(ts) for ts in now.values()) == 0
    assert trainer.offload() and trainer.onload() and (saver.pauses, saver.resumes) == (1, 1)


def test_the_fake_sees_adam_state_made_outside_its_region(tiny_model_dir):
    """The defect of issue 20 as the fake sees it: a model made inside the region, but Adam left to create
    its moments at its first step, outside it."""
    saver = RecordingSaverFake()
    with saver.region():
        model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert saver.bytes_outside(list(model.parameters())) == 0
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    moments = [v for st in optimizer.state.values() for k, v in st.items() if k != "step"]
    assert saver.bytes_outside(moments) == sum(t.nbytes for t in moments) > 0
    state = [v for st in optimizer.state.values() for v in st.values()]  # `step` too: the fake's "device" is CPU
    assert saver.adopt_optimizer_state(optimizer) == sum(t.nbytes for t in state)
    assert saver.bytes_outside(v for st in optimizer.state.values() for v in st.values()) == 0


def test_training_in_the_region_matches_training_without_it(tiny_model_dir):
    plain = TorchTrainer(tiny_model_dir, CFG, seed=0, device="cpu")
    saved = TorchTrainer(tiny_model_dir, CFG, seed=0, device="cpu", memory=RecordingSaverFake())
    assert not plain.memory.active and plain.offload() is False  # CPU: nothing moves
    for step in range(3):
        samples, adv = _samples(4, seed=10 + step), [1.0, -1.0, 0.25, 0.0]
        a, b = plain.train_step(samples, adv), saved.train_step(samples, adv)
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for p, q in zip(plain.model.parameters(), saved.model.parameters()):
        assert torch.equal(p, q)
    for st_p, st_q in zip(plain.optimizer.state.values(), saved.optimizer.state.values()):
        assert all(torch.equal(st_p[k], st_q[k]) for k in st_p)


@pytest.mark.parametrize("with_saver", [True, False])
def test_checkpoint_load_keeps_state_in_the_region(tiny_model_dir, tmp_path, with_saver):
    first = TorchTrainer(tiny_model_dir, CFG, seed=0, device="cpu", memory=RecordingSaverFake())
    first.train_step(_samples(4, seed=3), [1.0, -1.0, 1.0, -1.0])
    first.save_checkpoint(tmp_path / "ckpt")
    saver = RecordingSaverFake() if with_saver else None
    second = TorchTrainer(tiny_model_dir, CFG, seed=5, device="cpu", memory=saver)
    second.load_checkpoint(tmp_path / "ckpt")
    if saver is not None:
        assert saver.bytes_outside(_state_tensors(second)) == 0  # load_state_dict's new tensors were adopted
    for st_a, st_b in zip(first.optimizer.state.values(), second.optimizer.state.values()):
        assert all(torch.equal(st_a[k], st_b[k]) for k in st_a)
    samples = _samples(4, seed=4)
    a, b = first.train_step(samples, [1.0, -1.0, 1.0, -1.0]), second.train_step(samples, [1.0, -1.0, 1.0, -1.0])
    assert a["loss"] == b["loss"]
    assert all(torch.equal(p, q) for p, q in zip(first.model.parameters(), second.model.parameters()))
