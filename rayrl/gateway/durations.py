"""How long the gateway's own steps take, kept as log-bucketed histograms (constant memory, any run length).

Why: the gateway's cost per turn is what decides how many sessions one shard holds
(docs/operations.md, capacity), and a mean hides the pauses that matter (a garbage collection, a
large tree). Each :class:`DurationHistogram` counts durations in buckets ``GROWTH`` apart (2.5 %), from
1 µs to about 17 minutes, so its percentiles are within 2.5 % of the true ones at a few hundred bytes,
whether it has seen a hundred turns or a hundred million. Adding one costs a logarithm and a list
increment; the gateway times every recorded turn with it (``Gateway.durations``; ``GET /rayrl/stats``
with the admin token answers :meth:`DurationHistogram.summary` of each).
"""

from __future__ import annotations

import math
from typing import Any

MIN_S = 1e-6  # durations below this count in the first bucket
GROWTH = 1.025  # each bucket's upper edge is this times the previous one's
BUCKETS = 850  # 1.025 ** 850 * 1 µs: about 1,300 s; longer durations count in the last bucket
_LOG_GROWTH = math.log(GROWTH)


class DurationHistogram:
    """Durations in seconds, counted per log-spaced bucket; percentiles read as the bucket's upper edge
    (never below the true value by more than one bucket), the maximum kept exactly."""

    def __init__(self) -> None:
        self.counts = [0] * BUCKETS
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0

    def add(self, seconds: float) -> None:
        if seconds > MIN_S:
            index = min(BUCKETS - 1, int(math.log(seconds / MIN_S) / _LOG_GROWTH) + 1)
        else:
            index = 0
        self.counts[index] += 1
        self.count += 1
        self.total_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds

    def quantile(self, q: float) -> float:
        """The duration (s) below which a fraction ``q`` of those counted lie (0.0 when none were)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile {q} is not in [0, 1]")
        if self.count == 0:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for index, n in enumerate(self.counts):
            seen += n
            if seen >= rank:  # the last bucket has no upper edge: what overflowed into it reads as the max
                return self.max_s if index == BUCKETS - 1 else min(self.max_s, MIN_S * GROWTH ** index)
        return self.max_s

    def summary(self) -> dict[str, Any]:
        """Count, mean, p50, p90, p99, p99.9 and max, in milliseconds."""
        ms = {f"p{label}_ms": round(self.quantile(q) * 1e3, 4)
              for label, q in (("50", 0.5), ("90", 0.9), ("99", 0.99), ("99_9", 0.999))}
        mean = self.total_s / self.count if self.count else 0.0
        return {"count": self.count, "mean_ms": round(mean * 1e3, 4), **ms, "max_ms": round(self.max_s * 1e3, 4)}
