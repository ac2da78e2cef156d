"""The engine-trainer gap (rayrl/rl/logprob_gap.py): hand-checkable numbers, the meter over micro-batches
and ranks, the bound, and the torch trainer reporting it from its step's first forward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rayrl.rl.logprob_gap import GapMeter, gap_crossed


def logprob_gap_stats(trainer, rollout, mask=None) -> dict[str, float]:
    """The gap of one batch, as the trainer's meter reports it for a step of one micro-batch."""
    meter = GapMeter()
    meter.add(trainer, rollout, mask)
    return meter.stats(reduce=False)


def test_stats_by_hand():
    trainer = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    rollout = torch.tensor([-1.1, -2.0, -0.3, -9.0])
    mask = torch.tensor([True, True, True, False])  # the last token is stale: not counted
    stats = logprob_gap_stats(trainer, rollout, mask)
    d = np.array([0.1, 0.0, -0.2])
    assert stats["engine_gap/mean_abs"] == pytest.approx(np.abs(d).mean())
    assert stats["engine_gap/max_abs"] == pytest.approx(0.2)
    assert stats["engine_gap/kl"] == pytest.approx(np.mean(np.exp(d) - d - 1))
    assert stats["engine_gap/tokens"] == 3
    assert logprob_gap_stats(trainer, rollout, torch.zeros(4, dtype=torch.bool)) == {}
    with pytest.raises(ValueError, match="shape"):
        logprob_gap_stats(trainer, rollout[:3])


def test_kl_estimates_kl_engine_to_trainer():
    """Tokens sampled from the engine's distribution: the mean k3 converges to KL(engine || trainer)."""
    gen = torch.Generator().manual_seed(0)
    engine = torch.log_softmax(torch.randn(50, generator=gen), -1)
    trainer = torch.log_softmax(engine + 0.3 * torch.randn(50, generator=gen), -1)
    tokens = torch.multinomial(engine.exp(), 200_000, replacement=True, generator=gen)
    stats = logprob_gap_stats(trainer[tokens], engine[tokens])
    exact = float((engine.exp() * (engine - trainer)).sum())
    assert stats["engine_gap/kl"] == pytest.approx(exact, rel=0.05)


def test_meter_adds_micro_batches_like_one_batch():
    gen = torch.Generator().manual_seed(1)
    trainer, rollout = torch.randn(30, generator=gen), torch.randn(30, generator=gen)
    mask = torch.rand(30, generator=gen) > 0.3
    meter = GapMeter()
    for lo in range(0, 30, 7):
        meter.add(trainer[lo : lo + 7], rollout[lo : lo + 7], mask[lo : lo + 7])
    whole = logprob_gap_stats(trainer, rollout, mask)
    for key, value in meter.stats().items():
        assert value == pytest.approx(whole[key])
    assert meter.stats() == {}  # the meter starts again for the next step


def test_gap_crossed_reads_the_trainers_metric():
    assert gap_crossed({"train/engine_gap/mean_abs": 0.02}, 0.01) == 0.02
    assert gap_crossed({"train/engine_gap/mean_abs": 0.005}, 0.01) is None
    assert gap_crossed({"train/engine_gap/mean_abs": 0.5}, 0.0) is None  # 0: never
    assert gap_crossed({"train/engine_gap/mean_abs": math.nan}, 0.01) is None
    assert gap_crossed(None, 0.01) is None and gap_crossed({}, 0.01) is None


def _meter_rank(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        meter = GapMeter()
        if rank == 0:  # a rank that computed no loss (an earlier pipeline stage) adds nothing
            out.put((rank, meter.stats()))
            return
        d = torch.tensor([0.1, -0.3]) if rank == 1 else torch.tensor([0.2])
        meter.add(d, torch.zeros_like(d))
        out.put((rank, meter.stats()))
    finally:
        dist.destroy_process_group()


def test_meter_reduces_over_ranks():
    """Three gloo ranks in real processes: every rank reports the whole batch's gap."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_meter_rank, args=(r, 3, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    for rank in range(3):
        assert results[rank]["engine_gap/mean_abs"] == pytest.approx(0.2)
        assert results[rank]["engine_gap/max_abs"] == pytest.approx(0.3)
        assert results[rank]["engine_gap/tokens"] == 3


def test_torch_trainer_reports_the_gap_of_its_first_forward(tiny_model_dir):
    """The trainer's step metrics carry the gap between its own log-probs before the update and the
    rollout log-probs: shifted by a known amount on the fresh tokens, stale tokens left out."""
    from rayrl.config import TrainerConfig
    from rayrl.trainers.torch_backend import TorchTrainer
    from rayrl.types import Sample

    cfg = TrainerConfig(lr=5e-3, micro_batch_tokens=48, compute_dtype="float32")  # several micro-batches
    trainer = TorchTrainer(tiny_model_dir, cfg, seed=0, device="cpu")
    rng = np.random.default_rng(0)
    samples = []
    for i in range(4):
        tokens = rng.integers(10, 4000, size=24).astype(np.int32)
        with torch.no_grad():
            logits = trainer.model(torch.from_numpy(tokens[None].astype(np.int64))).logits[0].float()
        targets = torch.from_numpy(tokens[8:].astype(np.int64))[:, None]
        lp = torch.log_softmax(logits, -1)[7:-1].gather(-1, targets)[:, 0]
        versions = np.zeros(16, np.int32)
        shift = np.full(16, 0.01 * (i + 1), np.float32)  # the "engine" is off by a known amount
        if i == 3:
            versions[:] = -1  # sampled by an older policy: staleness, not engine numerics
            shift[:] = 5.0
        samples.append(Sample(tokens=tokens, prompt_length=8, loss_mask=np.ones(16, np.int8),
                              rollout_logprobs=lp.numpy() - shift, policy_versions=versions))
    metrics = trainer.train_step(samples, [1.0, -1.0, 1.0, -1.0])
    assert metrics["engine_gap/tokens"] == 48
    assert metrics["engine_gap/mean_abs"] == pytest.approx(0.02, abs=1e-4)
    assert metrics["engine_gap/max_abs"] == pytest.approx(0.03, abs=1e-4)
    assert metrics["engine_gap/kl"] == pytest.approx(np.mean([np.expm1(d) - d for d in (0.01, 0.02, 0.03)]), rel=0.05)
