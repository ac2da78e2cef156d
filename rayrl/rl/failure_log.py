"""Failed episodes logged once per cause: a step where 16 episodes crash the same way prints one line with
the count and one example, not the same traceback 16 times.

Episodes fail alike when their failure kind and their error's text agree once what differs between
otherwise equal errors is taken out (session and object ids, addresses, temporary paths, numbers):
:func:`error_signature`. The first time the run meets a signature, its line carries the whole error (a
program's stderr tail, a traceback); a signature seen in an earlier step is written short, its error's
last line (the exception, for a traceback) and the step it was first seen at. Every failed episode is
still written to ``episodes/`` with its whole error, and counted in ``failures/<kind>``; this is only
what the log says.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

from rayrl.rl.failures import failure_kind, is_infra
from rayrl.types import Episode

_VARIABLE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F-]{27}|0x[0-9a-fA-F]+|\b[0-9a-fA-F]{8,}\b|/tmp/[^\s'\":]+|\d+")
SHORT_CHARS = 300  # a repeated error's last line, cut to this


def error_signature(episode: Episode) -> tuple[str, str]:
    """``(failure kind, the error with ids, addresses, temporary paths and numbers blanked)``."""
    return failure_kind(episode), _VARIABLE.sub("#", episode.error or "")


def last_line(error: str | None) -> str:
    """The error's last non-empty line (a traceback's exception), cut to :data:`SHORT_CHARS`."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:SHORT_CHARS]


def how_counted(episode: Episode) -> str:
    """What training makes of a failed episode, in words."""
    if episode.info.get("discarded"):
        return f"its group was set aside ({episode.info['discarded']})"
    return "left out of training" if is_infra(episode) else f"scored {episode.reward:g}"


@dataclass
class FailureLog:
    """The run's failure causes met so far (signature -> the step it was first logged at)."""

    first_seen: dict[tuple[str, str], int] = field(default_factory=dict)

    def lines(self, step: int, episodes: Sequence[Episode]) -> list[str]:
        """One line per cause among the failed ``episodes`` of ``step``, most frequent first."""
        groups: dict[tuple[str, str], list[Episode]] = {}
        for e in episodes:
            if not e.ok:
                groups.setdefault(error_signature(e), []).append(e)
        out = []
        for signature, failed in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            first = failed[0]
            count = f"{len(failed)} episode{'s' * (len(failed) != 1)} failed"
            where = f"({signature[0]}; {how_counted(first)}) e.g. session={first.session_id} task={first.task_id}"
            seen = self.first_seen.get(signature)
            if seen is None:
                self.first_seen[signature] = step
                out.append(f"step {step}: {count} {where}: {first.error}")
            else:
                out.append(f"step {step}: {count} {where}, the same error as at step {seen}: "
                           f"{last_line(first.error)}")
        return out


@dataclass(frozen=True)
class OneCause:
    """The step's most common failure cause: the share of all the step's episodes that failed with it, out
    of ``count`` episodes, its first episode and the cause in words (kind and the error's last line)."""

    share: float
    count: int
    example: Optional[Episode]
    cause: str


def dominant_cause(episodes: Sequence[Episode]) -> OneCause:
    """Which single cause failed the most of ``episodes`` (a share of 1.0: every episode, one cause: a run that
    would train on nothing, which the ``one_cause_failures`` guard stops)."""
    signatures = Counter(error_signature(e) for e in episodes if not e.ok)
    if not signatures:
        return OneCause(0.0, len(episodes), None, "")
    signature, n = signatures.most_common(1)[0]
    example = next(e for e in episodes if not e.ok and error_signature(e) == signature)
    kind, last = signature[0], last_line(example.error)
    return OneCause(n / len(episodes), len(episodes), example,
                    last if last.startswith(f"{kind}: ") else f"{kind}: {last}")
