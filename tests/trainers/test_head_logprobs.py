"""The frozen-head log-probs (rayrl/trainers/head_logprobs.py): the same log-probs, entropies and hidden-state
gradients as the plain log-softmax over the whole logits matrix, chunk by chunk, with no logits matrix kept
for the backward pass; and the trainer takes that path exactly where the head does not train."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayrl.config import AlgorithmConfig, LoraConfig, TrainerConfig
from rayrl.rl.policy_losses import entropy_from_logits
from rayrl.trainers import head_logprobs
from rayrl.trainers.head_logprobs import frozen_head_logprobs
from rayrl.types import Sample

N, D, V = 11, 24, 301


def _case(bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(D, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    head.requires_grad_(False)
    hidden = torch.randn(N, D, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[3] = int(head(hidden[3]).argmax())  # one row whose target holds most of the mass
    return head, hidden, targets, torch.randn(N, generator=g), torch.randn(N, generator=g)


def _plain(head, hidden, targets):
    logits = head(hidden).float()
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy_from_logits(logits)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4, N, 64])  # one row, a short last chunk, one chunk, a chunk larger than N
@pytest.mark.parametrize("terms", ["logp", "entropy", "both"])
def test_log_probs_entropies_and_hidden_gradients_match_the_plain_path(bias, rows, terms):
    head, hidden, targets, a, b = _case(bias)
    h1 = hidden.clone().requires_grad_(True)
    logp1, ent1 = _plain(head, h1, targets)
    h2 = hidden.clone().requires_grad_(True)
    logp2, ent2 = frozen_head_logprobs(h2, head, targets, with_entropy=terms != "logp", rows=rows)
    assert torch.allclose(logp2, logp1, atol=1e-5) and (ent2 is None) == (terms == "logp")
    loss1 = (a * logp1).sum() if terms != "entropy" else 0
    loss2 = (a * logp2).sum() if terms != "entropy" else 0
    if terms != "logp":
        assert torch.allclose(ent2, ent1, atol=1e-5)
        loss1, loss2 = loss1 + (b * ent1).sum(), loss2 + (b * ent2).sum()
    loss1.backward()
    loss2.backward()
    assert torch.allclose(h2.grad, h1.grad, atol=1e-5, rtol=1e-4)
    assert h1.grad.abs().max() > 0.1  # a real gradient was compared


def test_the_backward_pass_keeps_no_vocabulary_sized_tensor():
    head, hidden, targets, a, b = _case(False)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        h = hidden.clone().requires_grad_(True)
        logp, ent = frozen_head_logprobs(h, head, targets, with_entropy=True, rows=4)
    assert saved and all(V not in shape for shape in saved), saved
    with torch.no_grad():  # a no-grad pass (reference, proximal) computes no gradient terms at all
        assert torch.allclose(frozen_head_logprobs(hidden, head, targets)[0], _plain(head, hidden, targets)[0],
                              atol=1e-5)


def test_a_head_that_trains_is_refused():
    head, hidden, targets, _, _ = _case(False)
    head.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="takes a gradient"):
        frozen_head_logprobs(hidden, head, targets)


def test_chunks_bound_the_logits_footprint():
    assert head_logprobs.chunk_rows(49152) * 49152 * 4 <= head_logprobs.CHUNK_BYTES
    assert head_logprobs.chunk_rows(10**9) == 1


def _samples(n: int = 4) -> list[Sample]:
    rng = np.random.default_rng(0)
    return [Sample(tokens=rng.integers(10, 4000, size=20).astype(np.int32), prompt_length=8,
                   loss_mask=np.ones(12), policy_versions=np.zeros(12), rollout_logprobs=np.full(12, -8.0, np.float32))
            for _ in range(n)]


@pytest.mark.parametrize("rank", [0, 4])
def test_the_trainer_takes_the_chunked_path_exactly_where_the_head_is_frozen(tiny_model_dir, monkeypatch, rank):
    """LoRA's training forward and every no-grad pass go through it; full weights' training forward does not
    (its head trains). Both give the plain path's log-probs, entropies and adapter gradients."""
    from rayrl.trainers.torch_backend import TorchTrainer

    cfg = TrainerConfig(lr=1e-2, compute_dtype="float32", lora=LoraConfig(rank=rank))
    trainer = TorchTrainer(tiny_model_dir, cfg, algorithm=AlgorithmConfig(entropy_coef=0.01), seed=0, device="cpu")
    batch = trainer._micro_batch(_samples(), [1.0, -1.0, 0.5, -0.5])
    calls = []
    real = head_logprobs._FrozenHeadLogprobs.apply
    monkeypatch.setattr(head_logprobs._FrozenHeadLogprobs, "apply", lambda *a: calls.append(1) or real(*a))
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def run():
        logp, ent = trainer.token_logprobs(batch, with_entropy=True)
        ((logp * torch.linspace(-1, 1, len(logp))).sum() + ent.sum()).backward()
        grads = [p.grad.clone() for p in params]
        trainer.optimizer.zero_grad()
        return logp.detach(), ent.detach(), grads

    chunked = run()
    assert len(calls) == (1 if rank else 0)
    with torch.no_grad():
        trainer.token_logprobs(batch)
    assert len(calls) == (2 if rank else 1)
    monkeypatch.setattr("rayrl.trainers.torch_backend.head_is_frozen", lambda head: False)
    plain = run()
    assert len(calls) == (2 if rank else 1)
    assert torch.allclose(chunked[0], plain[0], atol=1e-5) and torch.allclose(chunked[1], plain[1], atol=1e-5)
    for g1, g2 in zip(chunked[2], plain[2]):
        assert torch.allclose(g1, g2, atol=1e-6, rtol=1e-4)
    assert any(g.abs().max() > 0 for g in chunked[2])
