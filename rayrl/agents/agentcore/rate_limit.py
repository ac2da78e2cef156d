"""A request-rate limiter shared by every thread of a launcher.

AgentCore Runtime's invoke quota is per account and region, so the limit is global for a run; the
launcher (one per run, see actors/agentcore_launcher.py) owns one ``RateLimiter`` and every request,
retries included, takes a slot from it.

Two rules, both enforced at the moment a request is let through:

- a token bucket refilled at ``rate`` per second holding at most ``burst`` tokens (``burst=1``: requests
  are paced at least ``1/rate`` apart, no bursts after an idle spell);
- a sliding window: never more than ``floor(rate)`` (at least 1) requests in any window of one second
  plus ``guard_s``.

The bucket alone admits ``burst + rate`` requests in a second that starts with a full bucket; the
window closes that gap, so "at most acr_tps_limit requests in any second" holds exactly on the
sender's clock. The service counts on its own clock, where network delays shift arrivals: requests
paced exactly one second per ``rate`` apart could arrive ``rate + 1`` within a second. ``guard_s``
(the launcher uses 50 ms) widens the window so the quota also holds where AgentCore measures it,
for delivery jitter up to ``guard_s``, at the cost of that fraction of peak rate. Waiting threads sleep
outside the lock and re-check, so a thread that overslept never
lets a request through early.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable


class RateLimiter:
    """``acquire()`` blocks until one more request fits both the token bucket and the 1-second window."""

    def __init__(
        self,
        rate: float,
        burst: int = 1,
        window_s: float = 1.0,
        guard_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = float(rate)
        self.burst = int(burst)
        self.window_s = window_s
        self.per_window = max(1, math.floor(rate * window_s))
        self._span_s = window_s + guard_s  # how long a grant counts against the window
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._refilled = clock()
        self._recent: deque[float] = deque()  # grant times inside the current window
        self.granted = 0
        self.waited_s = 0.0

    def _wait_needed(self, now: float) -> float:
        """0 when a request may go now (the caller holds the lock), else how long to wait."""
        self._tokens = min(float(self.burst), self._tokens + (now - self._refilled) * self.rate)
        self._refilled = now
        while self._recent and self._recent[0] <= now - self._span_s:
            self._recent.popleft()
        waits = [0.0]
        if self._tokens < 1.0:
            waits.append((1.0 - self._tokens) / self.rate)
        if len(self._recent) >= self.per_window:
            waits.append(self._recent[0] + self._span_s - now)
        return max(waits)

    def acquire(self) -> float:
        """Take one slot; returns the time (on the limiter's clock) it was granted."""
        start = self._clock()
        while True:
            with self._lock:
                now = self._clock()
                wait = self._wait_needed(now)
                if wait <= 0.0:
                    self._tokens -= 1.0
                    self._recent.append(now)
                    self.granted += 1
                    self.waited_s += now - start
                    return now
            # a tiny floor keeps float rounding at the window's edge from spinning
            self._sleep(max(wait, 1e-4))
