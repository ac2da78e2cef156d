"""Task sources that are generated rather than read from a file: reasoning-gym's procedural datasets.

Part of the run configuration (``data.reasoning_gym``; rayrl/config/schema.py has the conventions). The
dataset names and their own options are checked against the installed reasoning-gym before Ray starts
(rayrl/data/reasoning_gym.py ``check_sources``), since this module imports no package of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rayrl.config.checks import ConfigError

VAL_SEED_OFFSET = 1_000_003  # a held-out set's default seed is the training seed plus this


@dataclass
class ReasoningGymSource:
    """One reasoning-gym dataset in ``data.reasoning_gym``: its questions are the prompts, its own
    ``score_answer`` the reward (``rollout.reward: reasoning_gym``)."""

    name: str = ""  # the reasoning-gym dataset, e.g. basic_arithmetic, chain_sum, leg_counting
    size: int = 1000  # distinct training tasks generated from it
    seed: int = 0  # generator seed of the training tasks
    weight: Optional[float] = None  # how often a draw comes from this dataset, relative to the others (None: its size)
    config: dict[str, Any] = field(default_factory=dict)  # the dataset's own options (its config class's fields,
    # e.g. min_terms, max_digits)
    val_size: int = 0  # held-out tasks generated from it for validation (0: none)
    val_seed: Optional[int] = None  # generator seed of the held-out tasks (None: seed + 1000003); must differ from
    # seed; a held-out question equal to a training one is dropped

    def check(self, where: str) -> None:
        """Ranges; ``where`` is the entry's dotted name, e.g. ``data.reasoning_gym[0]``."""
        if not self.name:
            raise ConfigError(f"{where}.name: name a reasoning-gym dataset, e.g. basic_arithmetic")
        if self.size < 1:
            raise ConfigError(f"{where}.size: must be >= 1, got {self.size}")
        if self.seed < 0:
            raise ConfigError(f"{where}.seed: must be >= 0, got {self.seed}")
        if self.weight is not None and not self.weight > 0:
            raise ConfigError(f"{where}.weight: must be > 0, got {self.weight}")
        if self.val_size < 0:
            raise ConfigError(f"{where}.val_size: must be >= 0, got {self.val_size}")
        if self.held_out_seed() == self.seed:
            raise ConfigError(f"{where}.val_seed: equals seed ({self.seed}); held-out tasks come from another seed")
        for key in ("size", "seed"):
            if key in self.config:
                raise ConfigError(f"{where}.config.{key}: set {where}.{key} instead")

    def held_out_seed(self) -> int:
        return self.seed + VAL_SEED_OFFSET if self.val_seed is None else self.val_seed


def check_sources(sources: list[ReasoningGymSource]) -> None:
    """Each entry's ranges, with its index in the field name."""
    for i, source in enumerate(sources):
        source.check(f"data.reasoning_gym[{i}]")
