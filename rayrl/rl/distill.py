"""On-policy distillation: a teacher served by an engine scores the student's own samples, token by token.

The student samples as usual; a teacher model (``algorithm.distill_teacher``: an engine the run starts,
or the URL of one already running) computes the log-prob of every sampled response token given the
same context. The sampled reverse KL of each token, ``d_t = log pi_student(a_t) - log pi_teacher(a_t)``,
is an unbiased one-sample estimate of KL(student || teacher) at that position; subtracting
``distill_coef * d_t`` from the token's advantage makes the policy gradient minimise the reverse KL
along the student's own trajectories (Agarwal et al. 2024, "On-policy distillation of language
models: learning from self-generated mistakes"; Thinking Machines' tinker-cookbook and slime's OPD use
this form). It adds to whatever the estimator gave, so task reward and distillation mix; with a zero
reward it is pure distillation.

The student's log-prob is the rollout log-prob (the engine's, of the policy that sampled; an engine
scores the teacher too, so both sides have the same numerics). The teacher must share the student's
tokenizer: it scores the student's token ids as they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Sequence

import numpy as np

from rayrl.engines.client import EngineClient
from rayrl.rl.batch import Batch
from rayrl.types import Sample


class TeacherScorer:
    """The teacher's log-probs of samples' response tokens, from an engine at ``url`` (SGLang's API)."""

    def __init__(self, url: str, timeout_s: float = 600.0, concurrency: int = 8) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.concurrency = concurrency

    def score(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """One float32 array per sample, aligned with its response (``loss_mask``)."""
        return asyncio.run(self._score_all(samples))

    async def _score_all(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        client = EngineClient(self.url, timeout_s=self.timeout_s)
        gate = asyncio.Semaphore(self.concurrency)

        async def one(sample: Sample) -> np.ndarray:
            if sample.response_length == 0:
                return np.zeros(0, np.float32)
            async with gate:
                return await client.prompt_logprobs(sample.tokens, sample.prompt_length)

        try:
            return list(await asyncio.gather(*(one(s) for s in samples)))
        finally:
            await client.close()


def distill_batch(batch: Batch, teacher_logprobs: Sequence[np.ndarray], coef: float) -> Batch:
    """``batch`` with per-token advantages ``A - coef * (rollout_lp - teacher_lp)`` and the distillation
    metrics over the trained tokens: ``distill/reverse_kl`` (the mean sampled reverse KL, what the
    student learns to shrink), ``distill/student_logprob`` and ``distill/teacher_logprob``."""
    if len(teacher_logprobs) != len(batch.samples):
        raise ValueError(f"{len(teacher_logprobs)} teacher scorings for {len(batch.samples)} samples")
    token_adv, kl, student, teacher = [], [], [], []
    for sample, adv, t_lp in zip(batch.samples, batch.train_advantages(), teacher_logprobs):
        t_lp = np.asarray(t_lp, np.float32)
        if len(t_lp) != sample.response_length:
            raise ValueError(f"teacher gave {len(t_lp)} log-probs for {sample.response_length} response tokens")
        d = sample.rollout_logprobs - t_lp
        token_adv.append((np.asarray(adv, np.float32) - coef * d).astype(np.float32))
        trained = sample.loss_mask.astype(bool)
        kl.append(d[trained])
        student.append(sample.rollout_logprobs[trained])
        teacher.append(t_lp[trained])
    if kl and sum(len(k) for k in kl):
        metrics = {"distill/reverse_kl": float(np.concatenate(kl).mean()),
                   "distill/student_logprob": float(np.concatenate(student).mean()),
                   "distill/teacher_logprob": float(np.concatenate(teacher).mean())}
    else:
        metrics = {}
    return dataclasses.replace(batch, token_advantages=token_adv, metrics={**batch.metrics, **metrics})
