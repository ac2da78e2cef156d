"""A run's loss settings made concrete: the clip band, the aggregation and the TIS cap an ``auto`` or unset
``algorithm`` field becomes, from the traits of the losses' and estimators' tables.

Why a module of its own: rayrl/resolve.py makes these concrete before Ray starts, in the driver, and the
driver never runs a loss; the loss itself (rayrl/rl/objective.py) needs torch, which takes seconds to
import, so these torch-free rules live here and both read them.
"""

from __future__ import annotations

from rayrl.config import AlgorithmConfig, ConfigError
from rayrl.rl.advantages import advantage_estimator
from rayrl.rl.policy_losses import policy_loss

NARROW_BAND_TIS_CAP = 2.0  # algorithm.tis_cap when unset for a narrow-band loss (GSPO), whatever the schedule


def loss_aggregation(algo: AlgorithmConfig) -> str:
    """``loss_agg`` made concrete: as set, else what the loss's paper uses, else the estimator's, else
    token_mean (the traits of rayrl/rl/policy_losses.py and rayrl/rl/advantages.py)."""
    if algo.loss_agg != "auto":
        return algo.loss_agg
    return (policy_loss(algo.policy_loss).aggregation or advantage_estimator(algo.advantage_estimator).aggregation
            or "token_mean")


def clip_range(algo: AlgorithmConfig) -> tuple[float, float]:
    """``(clip_eps, clip_eps_high)``: as set, else the loss's own band; a loss of your own that declared none
    needs both set (ConfigError naming the one missing)."""
    band = policy_loss(algo.policy_loss).clip
    if band is None:
        for name in ("clip_eps", "clip_eps_high"):
            if getattr(algo, name) is None:
                raise ConfigError(f"algorithm.{name}: the policy loss {algo.policy_loss} declares no clip band; set "
                                  "algorithm.clip_eps and algorithm.clip_eps_high, or declare its band with "
                                  "rayrl.rl.policy_losses.loss_traits(clip=(low, high))")
        band = (0.0, 0.0)
    low, high = band
    return (low if algo.clip_eps is None else algo.clip_eps, high if algo.clip_eps_high is None else algo.clip_eps_high)


def default_tis_cap(algo: AlgorithmConfig, schedule_tis_cap: float) -> float:
    """``algorithm.tis_cap`` when unset: the schedule's own (on where samples can be stale:
    rayrl/orchestration/schedules.py ``tis_cap``), and on for a loss whose band is narrower than the
    engine-trainer gap whatever the schedule."""
    narrow = NARROW_BAND_TIS_CAP if policy_loss(algo.policy_loss).narrow_band else 0.0
    return max(schedule_tis_cap, narrow)
