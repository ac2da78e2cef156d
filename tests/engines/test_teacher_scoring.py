"""On-policy distillation (rayrl/rl/distill.py): a teacher served by a real engine server scores a
student's samples token by token (the model's own log-probs, checked against transformers), and the
per-token reverse-KL advantages worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayrl.config import AlgorithmConfig
from rayrl.engines.client import EngineError
from rayrl.rl.batch import Batch
from rayrl.rl.distill import TeacherScorer, distill_batch
from rayrl.rl.updates import sample_trains
from rayrl.types import Sample


def _sample(tokens: list[int], prompt: int, rollout: list[float], mask: list[int] | None = None) -> Sample:
    n = len(tokens) - prompt
    return Sample(tokens=np.asarray(tokens), prompt_length=prompt, loss_mask=mask or [1] * n,
                  rollout_logprobs=np.asarray(rollout, np.float32), policy_versions=np.zeros(n))


def test_the_teacher_engine_scores_each_response_token(server, reference_model):
    rng = np.random.default_rng(0)
    samples = [_sample(rng.integers(10, 4000, size=n).tolist(), p, [0.0] * (n - p)) for n, p in ((14, 5), (9, 1))]
    scores = TeacherScorer(server.url).score(samples)
    for s, got in zip(samples, scores):
        with torch.no_grad():
            logits = reference_model(torch.from_numpy(s.tokens.astype(np.int64))[None]).logits[0].float()
        want = torch.log_softmax(logits, -1)[:-1].gather(1, torch.from_numpy(s.tokens[1:].astype(np.int64))[:, None])
        assert got.dtype == np.float32 and len(got) == s.response_length
        assert got == pytest.approx(want[s.prompt_length - 1 :, 0].numpy(), abs=1e-4)
    with pytest.raises(EngineError):  # a prompt the engine refuses (outside its vocabulary) is an error, not zeros
        TeacherScorer(server.url).score([_sample([10, 10**9, 11], 1, [0.0, 0.0])])


def test_reverse_kl_advantages_by_hand():
    # two samples: the second's first response token is context (mask 0), so it counts in no metric
    a = _sample([1, 2, 3, 4], 2, [-1.0, -2.0])
    b = _sample([1, 2, 3, 4, 5], 2, [-0.5, -3.0, -1.0], mask=[0, 1, 1])
    batch = Batch([a, b], [0.5, 0.0], episodes_ok=2, episodes_failed=0)
    teacher = [np.array([-1.5, -1.0], np.float32), np.array([-9.0, -2.0, -1.0], np.float32)]
    out = distill_batch(batch, teacher, coef=2.0)
    # A_t - 2 * (student - teacher): a: 0.5 - 2 * 0.5 = -0.5, 0.5 - 2 * -1 = 2.5; b: 0 - 2 * (..) per token
    assert out.token_advantages[0].tolist() == pytest.approx([-0.5, 2.5])
    assert out.token_advantages[1].tolist() == pytest.approx([-17.0, 2.0, 0.0])
    # mean over trained tokens of student - teacher: (0.5 - 1.0 - 1.0 + 0.0) / 4
    assert out.metrics["distill/reverse_kl"] == pytest.approx(-1.5 / 4)
    assert out.metrics["distill/teacher_logprob"] == pytest.approx((-1.5 - 1.0 - 2.0 - 1.0) / 4)
    assert out.train_advantages()[0] is out.token_advantages[0] and batch.token_advantages is None
    # a sample with a zero episode advantage now trains: the teacher disagrees with it token by token
    assert sample_trains(b, out.token_advantages[1], AlgorithmConfig()) and not sample_trains(b, 0.0, AlgorithmConfig())
    with pytest.raises(ValueError, match="teacher gave 1 log-probs for 2 response tokens"):
        distill_batch(batch, [np.zeros(1), teacher[1]], coef=1.0)
