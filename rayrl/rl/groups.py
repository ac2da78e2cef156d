"""GRPO groups: one task's episodes, and which completed groups must run again instead of training.

A group is ``rollout.group_size`` episodes of one task. GRPO's advantage of an episode is measured
against the other episodes of its group, so a group is the unit every schedule handles: it is trained
whole or dropped whole, never split. ``Group`` holds the episodes as they come back (by index, so a
re-run episode replaces rather than duplicates) and knows how stale its trained tokens are;
:func:`split_stale` is the async schedules' filter, :func:`split_short` every schedule's filter for groups
where infrastructure failures left too few scored episodes, :func:`equal_reward` what DAPO's dynamic
sampling looks at. A group that must run again keeps its task and gets a new id, so the task is neither
lost nor trained twice. The dispatcher (actors/dispatch.py) fills groups; this module has no Ray so the
rules are testable on hand-built episodes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rayrl.rl.advantages import REWARD_TOLERANCE
from rayrl.rl.failures import failure_kind, is_scored
from rayrl.rl.staleness import sample_staleness
from rayrl.types import Episode, Task


@dataclass
class Group:
    """One task's episodes (how old their tokens are is read from the samples' own policy versions)."""

    task: Task
    group_id: str
    size: int
    episodes: dict[int, Episode] = field(default_factory=dict)
    attempts: Counter = field(default_factory=Counter)  # episode index -> re-queues
    reruns: int = 0  # times this task's group was run again (too stale, or too few episodes succeeded)

    @property
    def complete(self) -> bool:
        return len(self.episodes) == self.size

    def ordered(self) -> list[Episode]:
        return [self.episodes[i] for i in sorted(self.episodes)]

    @property
    def scored(self) -> int:
        """Episodes whose reward stands: completed ones and the agent's own failures (rayrl/rl/failures.py
        ``is_scored``); only infrastructure failures are missing from the group's statistics."""
        return sum(1 for e in self.episodes.values() if is_scored(e))

    def infra_causes(self) -> Counter:
        """Failure kind -> count over the episodes infrastructure failed."""
        return Counter(failure_kind(e) for e in self.episodes.values() if not is_scored(e))

    def staleness(self, version: int) -> int:
        """Policy versions between ``version`` (the weights about to train) and the oldest trained token
        of the group's scored episodes; 0 for a group with nothing to train."""
        ages = sample_staleness([s for e in self.episodes.values() if is_scored(e) for s in e.samples], version)
        return max(ages, default=0)


def split_stale(groups: list[Group], version: int, max_staleness: int) -> tuple[list[Group], list[Group]]:
    """(fresh, stale): a group is stale when its oldest trained token is more than ``max_staleness``
    policy versions behind ``version``. Whole groups go: GRPO's advantages need the group complete."""
    fresh = [g for g in groups if g.staleness(version) <= max_staleness]
    stale = [g for g in groups if g.staleness(version) > max_staleness]
    return fresh, stale


def split_short(groups: list[Group], min_episodes: int, max_reruns: int) -> tuple[list[Group], list[Group]]:
    """(keep, rerun): a group where infrastructure failures left fewer than ``min_episodes`` (at most its
    size) scored episodes cannot give its episodes a fair baseline, so its task runs again as a new group,
    at most ``max_reruns`` times; after that it is kept as it is (the failures stay counted, and what was
    scored trains if the advantages allow). The agent's own failures are scored (with the reward the
    reward function gave them), so they never make a group run again: that would only repeat them."""
    keep: list[Group] = []
    rerun: list[Group] = []
    for group in groups:
        short = group.scored < min(min_episodes, group.size) and group.reruns < max_reruns
        (rerun if short else keep).append(group)
    return keep, rerun


def equal_reward(group: Group, tolerance: float = REWARD_TOLERANCE) -> float | None:
    """The reward every scored episode of ``group`` got, when they all got the same (a group-baseline
    advantage is then exactly zero for each, rayrl/rl/advantages.py: no learning signal); None when the
    rewards differ or none is scored."""
    rewards = [e.reward for e in group.episodes.values() if is_scored(e)]
    if not rewards or max(rewards) - min(rewards) > tolerance:
        return None
    return rewards[0]
