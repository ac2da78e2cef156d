"""The trainer's memory saver without a GPU: the no-op behaviour, and the parts of offload that are plain
torch: the host backup's copies, the region's segments, eager optimizer state."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
import torch

from rayrl.trainers.memory_saver import (
    HostBackup,
    MemorySaver,
    _Intervals,
    init_optimizer_state,
    pool_of,
    pool_segments,
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_no_op_on_cpu_with_a_clear_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="rayrl.trainers.memory_saver"):
        saver = MemorySaver(enabled=True)
    assert not saver.active
    assert "no CUDA device" in caplog.text
    with saver.region():
        w = torch.ones(4)
    with saver.outside():
        pass
    assert saver.pause() is False and saver.resume() is False and not saver.paused
    assert torch.equal(w, torch.ones(4))
    assert saver.bytes_outside([w]) == 0 and saver.region_segments() == []
    with caplog.at_level(logging.INFO, logger="rayrl.trainers.memory_saver"):
        MemorySaver(enabled=False)
    assert "memory saver off" in caplog.text


def test_saver_for_a_cpu_trainer_is_a_no_op_even_where_cuda_exists(caplog):
    with caplog.at_level(logging.INFO, logger="rayrl.trainers.memory_saver"):
        saver = MemorySaver(enabled=True, device="cpu")
    assert not saver.active and "no CUDA device" in caplog.text


def _view_of_host_memory(address: int, size: int) -> torch.Tensor:
    """A writable uint8 tensor over host memory at ``address`` (what cuda_bytes is for device memory)."""
    return torch.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=torch.uint8)


def _segments_of(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.nbytes) for t in tensors]


def test_host_backup_restores_every_byte_and_reuses_its_buffer():
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (4096, 1, 123_457, 65_536)]
    originals = [b.clone() for b in blocks]
    backup = HostBackup(_view_of_host_memory, pin=False)
    for cycle in range(3):
        assert backup.save(_segments_of(blocks)) == sum(b.nbytes for b in blocks)
        for b in blocks:  # what a released-then-remapped region holds: garbage
            b.fill_(cycle + 7)
        assert backup.restore() == sum(b.nbytes for b in blocks)
        assert all(torch.equal(b, o) for b, o in zip(blocks, originals))
    assert backup.allocations == 1  # one host buffer for every cycle
    first = backup.buffer
    assert backup.save(_segments_of(blocks[:2])) == 4097 and backup.buffer is first  # smaller: reused
    bigger = blocks + [torch.full((300_000,), 3, dtype=torch.uint8)]
    backup.save(_segments_of(bigger))
    assert backup.allocations == 2 and backup.buffer.numel() == sum(b.nbytes for b in bigger)
    bigger[-1].zero_()
    backup.restore()
    assert bool((bigger[-1] == 3).all())


def test_region_segments_are_found_by_pool_and_device():
    snapshot = [  # the fields of torch.cuda.memory_snapshot() that are read
        {"device": 0, "address": 3000, "total_size": 1000, "segment_pool_id": (1, 7)},
        {"device": 0, "address": 1000, "total_size": 500, "segment_pool_id": (1, 7)},
        {"device": 0, "address": 8000, "total_size": 100, "segment_pool_id": (0, 0)},  # default pool
        {"device": 1, "address": 1000, "total_size": 500, "segment_pool_id": (1, 7)},  # another device
    ]
    assert pool_segments(snapshot, {(1, 7)}, device=0) == [(1000, 500), (3000, 1000)]
    assert pool_of(snapshot, 3999) == (1, 7) and pool_of(snapshot, 8050) == (0, 0)
    assert pool_of(snapshot, 4000) is None
    index = _Intervals(pool_segments(snapshot, {(1, 7)}, device=0))
    assert [index.holds(a) for a in (999, 1000, 1499, 1500, 2999, 3000, 3999, 4000)] == [
        False, True, True, False, False, True, True, False,
    ]  # fmt: skip


def _tiny_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train(net: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    ],
    ids=["adamw", "adam-amsgrad", "adamw-for-loop"],
)
def test_eager_adam_state_is_what_the_first_step_makes(make):
    lazy_net, eager_net = _tiny_net(0), _tiny_net(0)
    lazy, eager = make(lazy_net.parameters()), make(eager_net.parameters())
    assert init_optimizer_state(eager) == 4 and len(lazy.state) == 0
    made = {id(p): {k: v.clone() for k, v in eager.state[p].items()} for p in eager_net.parameters()}
    assert all(bool((v == 0).all()) for st in made.values() for v in st.values())
    _train(lazy_net, lazy, 1)
    _train(eager_net, eager, 1)
    for p_lazy, p_eager in zip(lazy_net.parameters(), eager_net.parameters()):
        s_lazy, s_eager = lazy.state[p_lazy], eager.state[p_eager]
        assert s_lazy.keys() == s_eager.keys()
        for key in s_lazy:
            a, b = s_lazy[key], s_eager[key]
            assert (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape), key
    _train(lazy_net, lazy, 3)
    _train(eager_net, eager, 3)
    for p_lazy, p_eager in zip(lazy_net.parameters(), eager_net.parameters()):
        assert torch.equal(p_lazy, p_eager)  # bit for bit the same training
    assert init_optimizer_state(eager) == 4  # state already there: left alone
    assert all(torch.equal(eager.state[p]["exp_avg"], lazy.state[q]["exp_avg"])
               for p, q in zip(eager_net.parameters(), lazy_net.parameters()))  # fmt: skip


def test_optimizer_without_eager_state_is_named_in_the_log(caplog):
    net = _tiny_net(0)
    with caplog.at_level(logging.WARNING, logger="rayrl.trainers.memory_saver"):
        assert init_optimizer_state(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)) == 0
    assert "SGD has no eager state initialisation" in caplog.text


class MegatronWrapperStandIn:
    """STANDS IN for a megatron-core 0.15 optimizer wrapper (megatron-core needs CUDA and is not a CPU test
    dependency): the attributes ``init_optimizer_state`` reads, named as Megatron names them: the wrapped
    torch optimizer (``optimizer``), ``config``, and ``init_state_fn(optimizer, config)``, which Megatron
    builds for Adam to make zeroed ``exp_avg``/``exp_avg_sq`` before loading a checkpoint."""

    def __init__(self, optimizer: torch.optim.Optimizer, init_state_fn=None) -> None:
        self.optimizer = optimizer
        self.config = {"stand_in": True}
        self.init_state_fn = init_state_fn


class ChainedStandIn:
    """STANDS IN for Megatron's ChainedOptimizer (dense and expert parameters in two wrapped optimizers)."""

    def __init__(self, *wrappers: MegatronWrapperStandIn) -> None:
        self.chained_optimizers = list(wrappers)


def test_megatron_state_is_made_by_megatrons_own_init_state_fn():
    dense, expert = _tiny_net(0), _tiny_net(1)
    calls = []

    def megatron_like_init(opt, config):  # what megatron-core's Adam init_state_fn makes
        calls.append(config)
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p)

    # a fused Adam Megatron wraps is no torch Adam: its state comes from init_state_fn; a torch AdamW
    # (Megatron's fallback without TE and apex) gets exactly what its own first step makes, `step` included
    fused_like = torch.optim.Adagrad(expert.parameters(), lr=0.1)
    chained = ChainedStandIn(MegatronWrapperStandIn(torch.optim.AdamW(dense.parameters(), lr=1e-3)),
                             MegatronWrapperStandIn(fused_like, megatron_like_init))  # fmt: skip
    fused_like.state.clear()  # Adagrad makes its state in __init__; Megatron's fused Adam makes none there
    assert init_optimizer_state(chained) == 8
    assert calls == [{"stand_in": True}]
    adamw = chained.chained_optimizers[0].optimizer
    assert all(set(adamw.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in dense.parameters())
    assert all(set(fused_like.state[p]) == {"exp_avg", "exp_avg_sq"} for p in expert.parameters())
    assert init_optimizer_state(chained) == 8 and len(calls) == 2  # Megatron's fn skips what has state


def test_preload_env_gives_torch_memory_saver_exactly_its_own_library(monkeypatch, caplog):
    """Issue 41 G: torch_memory_saver 0.0.9 hands the whole ``LD_PRELOAD`` string to ``ctypes.CDLL``
    (hooks/mode_preload.py, binary_wrapper.py), so a preload set before ours (jemalloc, a profiler) made
    the trainer ranks fail at their first region. The library's own code reads the environment we make."""
    import logging

    from torch_memory_saver.hooks.mode_preload import HookUtilModePreload

    from rayrl.trainers.saver_preload import preload_env

    other = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
    monkeypatch.setenv("LD_PRELOAD", other)
    with caplog.at_level(logging.WARNING, logger="rayrl.trainers.saver_preload"):
        env = preload_env(True)
    monkeypatch.setenv("LD_PRELOAD", env["LD_PRELOAD"])
    handed_to_cdll = HookUtilModePreload().get_path_binary()
    assert Path(handed_to_cdll).is_file(), handed_to_cdll
    assert Path(handed_to_cdll).name.startswith("torch_memory_saver_hook_mode_preload")
    assert other in caplog.text  # what the ranks go without is said
    monkeypatch.delenv("LD_PRELOAD")
    assert Path(preload_env(True)["LD_PRELOAD"]).is_file() and preload_env(False) == {}
