"""The one loss helper both trainer backends call: a micro-batch's log-probs in, its loss out.

Both backends (rayrl/trainers/torch_backend.py, megatron_backend.py) compute the log-probs of the
trained tokens their own way (padded micro-batches; packed THD sequences over TP/CP/PP), then hand
them to :meth:`Objective.loss` with the micro-batch's :class:`TokenBatch`. Everything that makes the
algorithm is here, once:

- **the ratio's denominator.** ``tis_cap`` 0: the rollout log-probs (the engine's, of the policy that
  sampled), at every update. ``tis_cap`` > 0: the *proximal* policy, the trainer's own log-probs before
  the step's first optimizer step, and each token's loss is weighted by the truncated importance
  weight ``min(exp(proximal - rollout), tis_cap)`` (decoupled PPO with TIS: Hilton et al. 2022, Yao et
  al. 2025; it corrects stale tokens and engine/trainer numerics). With one update per batch the
  proximal log-probs are the training forward's own (detached); with several (``num_steps_per_rollout``
  or ``epochs_per_rollout`` > 1) the backend runs one no-grad forward over the batch first
  (:meth:`needs_prepass`) and puts them in ``TokenBatch.proximal``.
- **the policy loss** ``algorithm.policy_loss`` names (rayrl/rl/policy_losses.py), the KL-in-reward
  shaping of the advantages (``A - kl_reward_coef * (proximal - ref)``, per token), the KL loss to the
  reference (k1/k2/k3), the entropy bonus and the SFT term.
- **the aggregation** (``algorithm.loss_agg``), as one weight per token precomputed from the
  mini-batch's *global* sizes (all ranks; rayrl/rl/updates.py), so the sum over micro-batches and ranks
  of ``(per_token * weight).sum()`` is exactly the configured mean:

  ===========================  ===============================================  =========================
  ``loss_agg``                 weight of a token of sequence i                  the loss is
  ===========================  ===============================================  =========================
  token_mean                   1 / N_tokens                                     mean over all tokens
  seq_mean_token_mean          1 / (n_i * N_seqs)                               mean of sequence means
  seq_mean_token_sum           1 / N_seqs                                       mean of sequence sums
  seq_mean_token_sum_norm      1 / (C * N_seqs), C = ``loss_agg_norm``          Dr.GRPO's constant norm
  ===========================  ===============================================  =========================

- **the first forward.** Every trained token's trainer log-prob from before the step's first optimizer
  step, with its rollout log-prob, is kept (:meth:`first_forward_logprobs`): the one place where the
  engine-vs-trainer gap (rayrl/rl/logprob_gap.py) is measured, whichever backend runs, over the tokens
  the engines sampled with the weights the trainer holds when the step begins (``TokenBatch.current``;
  :meth:`gap_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from rayrl.config import AlgorithmConfig
from rayrl.rl.logprob_gap import GapMeter
from rayrl.rl.loss_settings import clip_range, default_tis_cap, loss_aggregation
from rayrl.rl.policy_losses import PolicyLossInput, kl_estimate, policy_loss
from rayrl.rl.updates import MiniBatch, UpdatePlan, sft_applies
from rayrl.types import Sample

FIELDS = ("rollout_logp", "advantages", "seq_index", "weight", "sft", "current")  # per trained token, in order
STATS = ("loss", "pg_loss", "tokens", "clip", "approx_kl", "tis", "abs_lp_diff", "entropy", "ref_kl")


@dataclass
class TokenBatch:
    """One micro-batch's trained tokens, flattened in sample order (each tensor [T])."""

    rollout_logp: torch.Tensor
    advantages: torch.Tensor
    seq_index: torch.Tensor  # int64: the sample's position in the micro-batch
    weight: torch.Tensor  # aggregation weight (module docstring)
    sft: torch.Tensor  # 1.0 where the SFT term applies
    current: torch.Tensor  # 1.0 where the token was sampled by the weights the trainer holds at the step's start
    num_seqs: int
    proximal: Optional[torch.Tensor] = None  # the trainer's log-probs before the step's first update (pre-pass)
    ref_logp: Optional[torch.Tensor] = None  # the reference model's

    @classmethod
    def from_fields(cls, fields: dict[str, np.ndarray], num_seqs: int, device: torch.device) -> TokenBatch:
        tensors = {name: torch.from_numpy(fields[name]).to(device) for name in FIELDS}
        return cls(**tensors, num_seqs=num_seqs)


def token_advantages(sample: Sample, advantage: float | np.ndarray) -> np.ndarray:
    """The sample's advantage at each trained token: a scalar repeated, or an array over the response
    (rayrl/rl/batch.py ``token_advantages``) taken at the trained positions."""
    trained = np.nonzero(sample.loss_mask)[0]
    if np.ndim(advantage) == 0:
        return np.full(len(trained), float(advantage), np.float32)
    values = np.asarray(advantage, np.float32)
    if len(values) != sample.response_length:
        raise ValueError(f"per-token advantages: {len(values)} values for {sample.response_length} response tokens")
    return values[trained]


class Objective:
    """The configured loss for one rank (module docstring); ``algo`` may be unresolved (clip ranges and
    aggregation ``auto`` are made concrete as rayrl/resolve.py does; TIS unset as in a sync run: off,
    except for a narrow-band loss such as GSPO)."""

    def __init__(self, algo: AlgorithmConfig) -> None:
        self.algo = algo
        self.loss_kind = policy_loss(algo.policy_loss)
        self.policy_loss = self.loss_kind.fn
        self.clip_low, self.clip_high = clip_range(algo)
        self.aggregation = loss_aggregation(algo)
        self.tis_cap = default_tis_cap(algo, 0.0) if algo.tis_cap is None else algo.tis_cap
        if self.aggregation == "seq_mean_token_sum_norm" and algo.loss_agg_norm <= 0:
            raise ValueError("algorithm.loss_agg seq_mean_token_sum_norm needs loss_agg_norm > 0 (resolve() sets it)")
        self._first: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._first_open = False
        self.policy_version = 0  # the trainer's at the step's start (begin_step): what ``current`` compares
        self.gap = GapMeter()  # the step's engine-trainer gap, from the first forward (module docstring)

    # -- what the backend must provide ----------------------------------------------------------------

    @property
    def uses_reference(self) -> bool:
        return self.algo.uses_reference

    @property
    def uses_entropy(self) -> bool:
        return self.algo.entropy_coef > 0

    @staticmethod
    def needs_prepass(plan: UpdatePlan) -> bool:
        """Several optimizer steps: the proximal log-probs of every token come from one no-grad forward
        before the first (with one step, the training forward's own are the proximal ones)."""
        return plan.optimizer_steps > 1

    def sample_weight(self, trained_tokens: int, mb: MiniBatch) -> float:
        """The aggregation weight of each trained token of a sample with ``trained_tokens`` tokens."""
        if mb.tokens == 0:
            return 0.0
        if self.aggregation == "token_mean":
            return 1.0 / mb.tokens
        if self.aggregation == "seq_mean_token_mean":
            return 1.0 / (max(trained_tokens, 1) * mb.sequences)
        if self.aggregation == "seq_mean_token_sum":
            return 1.0 / mb.sequences
        if self.aggregation == "seq_mean_token_sum_norm":
            return 1.0 / (self.algo.loss_agg_norm * mb.sequences)
        raise ValueError(f"algorithm.loss_agg: unknown {self.aggregation!r}")

    def token_fields(self, samples: Sequence[Sample], advantages: Sequence[float | np.ndarray],
                     mb: MiniBatch) -> dict[str, np.ndarray]:
        """The per-token inputs of a micro-batch (``samples``, part of mini-batch ``mb``), flattened in
        sample order: what :class:`TokenBatch` holds, as numpy arrays (Megatron packs them by position)."""
        parts: dict[str, list[np.ndarray]] = {name: [] for name in FIELDS}
        for i, (s, a) in enumerate(zip(samples, advantages)):
            n = s.num_trained_tokens
            trained = np.nonzero(s.loss_mask)[0]
            sft = 1.0 if self.algo.sft_coef > 0 and sft_applies(s, self.algo) else 0.0
            parts["rollout_logp"].append(s.rollout_logprobs[trained].astype(np.float32))
            parts["advantages"].append(token_advantages(s, a))
            parts["seq_index"].append(np.full(n, i, np.int64))
            parts["weight"].append(np.full(n, self.sample_weight(n, mb), np.float32))
            parts["sft"].append(np.full(n, sft, np.float32))
            parts["current"].append((np.asarray(s.policy_versions)[trained] == self.policy_version).astype(np.float32))
        empty = {"seq_index": np.int64}
        return {name: np.concatenate(p) if p else np.zeros(0, empty.get(name, np.float32))
                for name, p in parts.items()}

    # -- the first forward (before the step's first optimizer step) -----------------------------------

    def begin_step(self, policy_version: int = 0) -> None:
        """A new train step on the trainer's ``policy_version``: forget the last one's first forward and
        record the next log-probs seen (call it before the step's :meth:`token_fields`)."""
        self._first, self._first_open = [], True
        self.policy_version = policy_version

    def record(self, logp: torch.Tensor, tb: TokenBatch) -> None:
        """Keep ``logp`` (the trainer's, detached) with the rollout log-probs while the step's first
        forward is going on, and add it to the step's engine-trainer gap; :meth:`loss` calls it, and the
        backends' no-grad pre-pass."""
        if self._first_open:
            self._first.append((logp.detach().float().cpu(), tb.rollout_logp.detach().float().cpu()))
            self.gap.add(logp, tb.rollout_logp, tb.current > 0)

    def gap_stats(self, device: Optional[torch.device] = None) -> dict[str, float]:
        """The step's engine-trainer gap (``engine_gap/*``), summed over every rank of the default process
        group when there is one: every rank calls it (rayrl/rl/logprob_gap.py)."""
        return self.gap.stats(device=device)

    def close_first_forward(self) -> None:
        """The step's first forward is over (its pre-pass ended, or the first optimizer step came)."""
        self._first_open = False

    def first_forward_logprobs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(trainer log-probs, rollout log-probs) of every trained token of this rank's step, from before
        its first optimizer step, concatenated in the order the micro-batches ran (float32, CPU)."""
        if not self._first:
            return torch.zeros(0), torch.zeros(0)
        return torch.cat([t for t, _ in self._first]), torch.cat([r for _, r in self._first])

    # -- the loss ----------------------------------------------------------------------------------------

    def loss(self, tb: TokenBatch, logp: torch.Tensor,
             entropy: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the mini-batch loss (call ``.backward()`` on it as it is: the
        aggregation's global normalisers are in the weights) and its statistics, summed over its tokens
        (detached; divide by the summed ``tokens`` after adding them over micro-batches and ranks)."""
        algo = self.algo
        self.record(logp, tb)
        proximal = tb.proximal if tb.proximal is not None else logp.detach()
        old = proximal if self.tis_cap > 0 else tb.rollout_logp
        adv = tb.advantages
        if algo.kl_reward_coef > 0:
            adv = adv - algo.kl_reward_coef * kl_estimate(proximal, self._ref(tb), "k1")
        out = self.policy_loss(PolicyLossInput(logp, old, adv, tb.seq_index, tb.num_seqs, self.clip_low,
                                               self.clip_high, algo.dual_clip_c))
        tis = torch.ones_like(logp)
        if self.tis_cap > 0 and not self.loss_kind.supervised:
            tis = torch.clamp(torch.exp(torch.clamp(proximal - tb.rollout_logp, max=20.0)), max=self.tis_cap)
        pg = out.per_token * tis
        per_token = pg
        ref_kl = torch.zeros((), device=logp.device)
        if algo.uses_reference:
            kind = algo.kl_loss_type if algo.kl_loss_coef > 0 else "k1"
            kl = kl_estimate(logp, self._ref(tb), kind)
            ref_kl = kl.detach().sum()
            if algo.kl_loss_coef > 0:
                per_token = per_token + algo.kl_loss_coef * kl
        ent = torch.zeros((), device=logp.device)
        if entropy is not None:
            ent = entropy.detach().sum()
            per_token = per_token - algo.entropy_coef * entropy
        if algo.sft_coef > 0:
            per_token = per_token - algo.sft_coef * tb.sft * logp
        loss = (per_token * tb.weight).sum()
        stats = {
            "loss": loss.detach(),
            "pg_loss": (pg.detach() * tb.weight).sum(),
            "tokens": torch.tensor(float(logp.numel()), device=logp.device),
            "clip": out.clipped.sum(),
            "approx_kl": (tb.rollout_logp - logp.detach()).sum(),
            "tis": tis.detach().sum(),
            "abs_lp_diff": (logp.detach() - tb.rollout_logp).abs().sum(),
            "entropy": ent,
            "ref_kl": ref_kl,
        }
        return loss, {k: v.float() for k, v in stats.items()}

    @staticmethod
    def _ref(tb: TokenBatch) -> torch.Tensor:
        if tb.ref_logp is None:
            raise RuntimeError("a KL to the reference is on but the backend gave no reference log-probs")
        return tb.ref_logp


def loss_metrics(sums: dict[str, float], optimizer_steps: int) -> dict[str, float]:
    """A train step's reported figures from its statistics summed over micro-batches (and ranks):
    ``loss`` and ``pg_loss`` per optimizer step, the rest per trained token."""
    tokens = max(sums.get("tokens", 0.0), 1.0)
    steps = max(optimizer_steps, 1)
    return {
        "loss": sums.get("loss", 0.0) / steps,
        "pg_loss": sums.get("pg_loss", 0.0) / steps,
        "clip_fraction": sums.get("clip", 0.0) / tokens,
        "approx_kl": sums.get("approx_kl", 0.0) / tokens,
        "tis_weight_mean": sums.get("tis", 0.0) / tokens,
        "logprob_abs_diff": sums.get("abs_lp_diff", 0.0) / tokens,
        "entropy_mean": sums.get("entropy", 0.0) / tokens,
        "ref_kl_mean": sums.get("ref_kl", 0.0) / tokens,
    }
