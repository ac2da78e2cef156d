"""The engine-trainer gap: how far the engine's log-probs of the tokens it sampled are from the trainer's.

Every trained token carries the log-prob the engine gave it when it sampled it (the rollout log-prob);
the trainer recomputes it in its first forward pass of the step, before the optimizer moves the weights.
Where both ran the same weights, any difference is numerics: the engine's weight format (fp16-packed
weights, engine.weight_format), kernels, batch shapes, the trainer's compute dtype. Importance ratios and
the PPO clip see that difference as if it were a policy change, so it is measured every step:

- ``engine_gap/mean_abs`` and ``engine_gap/max_abs``: mean and max of |trainer - rollout| log-prob;
- ``engine_gap/kl``: KL(engine || trainer) over the same tokens, with the k3 estimator
  ``exp(d) - d - 1`` (d = trainer - rollout), which is never negative and has low variance for tokens
  sampled from the engine's distribution;
- ``engine_gap/tokens``: how many tokens it was measured on.

Only tokens the engine sampled with the weights the trainer holds at that step are counted (``mask``):
a token from an older policy version (async schedules) differs by the policy change as well, which is
staleness, not numerics. The backends call :class:`GapMeter` (one ``add`` per micro-batch's loss, one
``stats`` for the step's metrics); the pipeline compares ``mean_abs`` with ``engine.max_logprob_gap``
(:func:`gap_crossed`) and makes fp16-packed engines fall back to float32 when it is crossed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:  # the meter runs on trainer ranks, which import torch; the driver reads gap_crossed alone
    import torch

PREFIX = "engine_gap/"
MEAN_KEY = "train/engine_gap/mean_abs"  # as the schedules name the trainer's metrics


def _sums(trainer: torch.Tensor, rollout: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """[sum |d|, sum k3(d), count, max |d|] over the masked tokens (d = trainer - rollout), float64.
    ``trainer`` and ``rollout`` are aligned per token (any shape, the same for both)."""
    import torch

    if trainer.shape != rollout.shape:
        raise ValueError(f"trainer and rollout log-probs differ in shape: {tuple(trainer.shape)} != "
                         f"{tuple(rollout.shape)}")
    d = trainer.detach().double() - rollout.detach().double()
    if mask is not None:
        d = d[mask.to(torch.bool)]
    if d.numel() == 0:
        return torch.zeros(4, dtype=torch.float64, device=trainer.device)
    a = d.abs()
    return torch.stack([a.sum(), (torch.expm1(d) - d).sum(), torch.tensor(float(d.numel()), dtype=torch.float64,
                                                                          device=d.device), a.max()])


def _stats(sums: torch.Tensor) -> dict[str, float]:
    total_abs, total_kl, count, largest = (float(x) for x in sums.tolist())
    if count <= 0:
        return {}
    return {f"{PREFIX}mean_abs": total_abs / count, f"{PREFIX}max_abs": largest,
            f"{PREFIX}kl": total_kl / count, f"{PREFIX}tokens": count}


class GapMeter:
    """The gap over one train step, added micro-batch by micro-batch, reduced over ranks at the end.

    ``stats(reduce=True)`` sums (and maxes) over every rank of the default process group when one is
    initialised: a rank that computed no loss (a pipeline stage before the last, an empty shard)
    contributes nothing, and a token counted by several tensor-parallel ranks of one replica is counted
    as often in the sum as in the count, so the means and the max are the batch's. Every rank must call
    it then, as for any collective.
    """

    def __init__(self) -> None:
        self._sums: Optional[torch.Tensor] = None

    def add(self, trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
            mask: Optional[torch.Tensor] = None) -> None:
        import torch

        part = _sums(trainer_logprobs, rollout_logprobs, mask)
        if self._sums is None:
            self._sums = part
        else:
            self._sums = torch.cat([self._sums[:3] + part[:3], torch.maximum(self._sums[3:], part[3:])])

    def stats(self, reduce: bool = True, device: Optional[torch.device] = None) -> dict[str, float]:
        """The step's gap (and a fresh meter for the next step). ``device``: where a reduction runs
        (the process group's device: CUDA for NCCL)."""
        import torch
        import torch.distributed as dist

        sums = self._sums if self._sums is not None else torch.zeros(4, dtype=torch.float64)
        self._sums = None
        if reduce:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                sums = sums.to(device or sums.device)
                head, largest = sums[:3].clone(), sums[3:].clone()
                dist.all_reduce(head)
                dist.all_reduce(largest, op=dist.ReduceOp.MAX)
                sums = torch.cat([head, largest]).cpu()
        return _stats(sums.cpu())


def gap_crossed(train_metrics: Optional[Mapping[str, Any]], bound: float) -> Optional[float]:
    """The step's mean gap when it exceeds ``bound`` (``engine.max_logprob_gap``; 0: never), else None."""
    if not bound or not train_metrics:
        return None
    gap = train_metrics.get(MEAN_KEY)
    if isinstance(gap, (int, float)) and math.isfinite(gap) and gap > bound:
        return float(gap)
    return None
