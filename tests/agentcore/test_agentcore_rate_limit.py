"""RateLimiter: at most floor(rate) grants in any one-second window, no bursts beyond ``burst``."""

from __future__ import annotations

import threading

import pytest
from _agentcore_kit import max_per_window

from rayrl.agents.agentcore.rate_limit import RateLimiter


class FakeClock:
    """Time that moves only when someone sleeps: the limiter's arithmetic, free of scheduling noise."""

    def __init__(self) -> None:
        self.now = 100.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds



@pytest.mark.parametrize("rate,burst", [(10.0, 1), (10.0, 10), (3.5, 2), (1.0, 1)])
def test_never_more_than_rate_per_window_fake_clock(rate, burst):
    clock = FakeClock()
    limiter = RateLimiter(rate, burst, clock=clock, sleep=clock.sleep)
    grants = [limiter.acquire() for _ in range(60)]
    assert max_per_window(grants) == max(1, int(rate))  # reaches the limit, never passes it
    # sustained: 60 grants need at least (60 - per_window) / per_window further seconds
    assert grants[-1] - grants[0] >= (60 - max(1, int(rate))) / max(1, int(rate)) - 1e-9


@pytest.mark.parametrize("burst", [1, 8])
def test_guard_keeps_the_limit_under_delivery_jitter(burst):
    """Any arrival delays of at most guard_s keep every one-second window at the limit or below."""
    import random

    clock = FakeClock()
    limiter = RateLimiter(8.0, burst, guard_s=0.05, clock=clock, sleep=clock.sleep)
    grants = [limiter.acquire() for _ in range(80)]
    rng = random.Random(0)
    for _ in range(20):
        arrivals = [g + rng.uniform(0.0, 0.05) for g in grants]
        assert max_per_window(arrivals) <= 8


def test_burst_one_paces_requests_evenly():
    clock = FakeClock()
    limiter = RateLimiter(5.0, 1, clock=clock, sleep=clock.sleep)
    grants = [limiter.acquire() for _ in range(20)]
    gaps = [b - a for a, b in zip(grants, grants[1:])]
    assert min(gaps) >= 0.2 - 1e-9  # 1 / rate apart: no two requests back to back


def test_idle_spell_allows_at_most_burst_back_to_back():
    clock = FakeClock()
    limiter = RateLimiter(10.0, 4, clock=clock, sleep=clock.sleep)
    clock.sleep(60.0)  # idle: the bucket is full
    grants = [limiter.acquire() for _ in range(8)]
    assert sum(g == grants[0] for g in grants) == 4


def test_many_threads_real_clock_stay_within_the_limit():
    limiter = RateLimiter(20.0, 5)
    grants: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(5):
            t = limiter.acquire()
            with lock:
                grants.append(t)

    threads = [threading.Thread(target=worker) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(grants) == 60 and limiter.granted == 60
    assert max_per_window(grants) <= 20  # exact on the limiter's own clock, whatever the scheduling


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        RateLimiter(0.0)
    with pytest.raises(ValueError):
        RateLimiter(1.0, burst=0)
