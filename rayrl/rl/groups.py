"""GRPO groups: one task's episodes, and which completed groups must run again instead of training.

A group is ``rollout.group_size`` episodes of one task. GRPO's advantage of an episode is measured
against the other episodes of its group, so a group is the unit every schedule handles: it is trained
whole or dropped whole, never split. ``Group`` holds the episodes as they come back (by index, so a
re-run episode replaces rather than duplicates) and knows how stale its trained tokens are;
:func:`split_stale` is the async schedules' filter, :func:`split_short` every schedule's filter for groups
where too few episodes succeeded, :func:`equal_reward` what DAPO's dynamic sampling looks at. A group that must run again keeps its task and gets a new id, so the
task is neither lost nor trained twice. The dispatcher (actors/dispatch.py) fills groups; this module
has no Ray so the rules are testable on hand-built episodes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rayrl.rl.staleness import sample_staleness
from rayrl.types import Episode, Task


@dataclass
class Group:
    """One task's episodes; ``version`` is the policy version when its first episode started."""

    task: Task
    group_id: str
    size: int
    version: int = -1
    episodes: dict[int, Episode] = field(default_factory=dict)
    attempts: Counter = field(default_factory=Counter)  # episode index -> re-queues
    started_at: float = 0.0
    reruns: int = 0  # times this task's group was run again (too stale, or too few episodes succeeded)

    @property
    def complete(self) -> bool:
        return len(self.episodes) == self.size

    def ordered(self) -> list[Episode]:
        return [self.episodes[i] for i in sorted(self.episodes)]

    @property
    def succeeded(self) -> int:
        """Episodes that completed (an agent's wrong answer counts: only failures do not)."""
        return sum(1 for e in self.episodes.values() if e.ok)

    def staleness(self, version: int) -> int:
        """Policy versions between ``version`` (the weights about to train) and the oldest trained token
        of the group's successful episodes; 0 for a group with nothing to train."""
        ages = sample_staleness([s for e in self.episodes.values() if e.ok for s in e.samples], version)
        return max(ages, default=0)


def split_stale(groups: list[Group], version: int, max_staleness: int) -> tuple[list[Group], list[Group]]:
    """(fresh, stale): a group is stale when its oldest trained token is more than ``max_staleness``
    policy versions behind ``version``. Whole groups go: GRPO's advantages need the group complete."""
    fresh = [g for g in groups if g.staleness(version) <= max_staleness]
    stale = [g for g in groups if g.staleness(version) > max_staleness]
    return fresh, stale


def split_short(groups: list[Group], min_episodes: int, max_reruns: int) -> tuple[list[Group], list[Group]]:
    """(keep, rerun): a group where fewer than ``min_episodes`` episodes (at most its size) succeeded (the rest failed, mostly
    for infrastructure reasons) cannot give its episodes a fair baseline, so its task runs again as a new
    group, at most ``max_reruns`` times; after that it is kept as it is (the failures stay counted, and
    what succeeded trains if the advantages allow)."""
    keep: list[Group] = []
    rerun: list[Group] = []
    for group in groups:
        short = group.succeeded < min(min_episodes, group.size) and group.reruns < max_reruns
        (rerun if short else keep).append(group)
    return keep, rerun


def equal_reward(group: Group, tolerance: float = 1e-9) -> float | None:
    """The reward every successful episode of ``group`` got, when they all got the same (a group-baseline
    advantage is then zero for each: no learning signal); None when the rewards differ or none succeeded."""
    rewards = [e.reward for e in group.episodes.values() if e.ok]
    if not rewards or max(rewards) - min(rewards) > tolerance:
        return None
    return rewards[0]

