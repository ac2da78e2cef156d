"""The run's parts start together (rayrl/orchestration/start_together.py) and its start is recorded
(rayrl/startup.py): plain threads and functions, no Ray; a second.

tests/pipeline/test_e2e_pipeline.py checks the same on the real pipeline: every part began before any was ready.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from rayrl.orchestration.start_together import PartNotStarted, StartTogether
from rayrl.startup import FILE, StartupClock, process_start_time, read_starts


def test_parts_run_at_the_same_time():
    """Each part waits at a barrier for the other: started one after the other, the first would wait alone
    and the barrier would break."""
    meet = threading.Barrier(3, timeout=10)
    start = StartTogether()
    parts = [start.part(name, lambda name=name: (meet.wait(), name)[1]) for name in ("engines", "trainer", "gateway")]
    start.wait()
    assert [p.result() for p in parts] == ["engines", "trainer", "gateway"]


def test_a_part_waits_on_another_where_it_needs_it():
    order: list[str] = []
    start = StartTogether()
    engines = start.part("engines", lambda: (time.sleep(0.2), order.append("engines up"))[0])

    def trainer() -> str:
        start.after(engines)
        order.append("trainer built")
        return "trainer"

    part = start.part("trainer", trainer)
    start.wait()
    assert part.result() == "trainer" and order == ["engines up", "trainer built"]


def test_the_first_failure_is_raised_at_once_and_every_part_is_stopped():
    """The failing part's own error, not the one of a part that waited on it; parts already up are stopped
    at once, a part still starting as soon as it is up; the wait does not sit out the slow part."""
    stopped: list[str] = []
    release = threading.Event()
    start = StartTogether()
    up = start.part("sandboxes", lambda: "pool", stop=stopped.append)
    time.sleep(0.05)  # up before the failure
    slow = start.part("engines", lambda: (release.wait(10), "fleet")[1], stop=stopped.append)

    def broken() -> None:
        time.sleep(0.1)
        raise ValueError("trainer.lr: bad on purpose")

    start.part("trainer", broken)

    def needs_trainer() -> None:
        start.after(start.parts["trainer"])

    start.part("workers", needs_trainer)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="bad on purpose"):
        start.wait()
    assert time.monotonic() - t0 < 5  # not after the slow part
    assert stopped == ["pool"] and up.result() == "pool"
    release.set()
    slow.result(timeout=10)
    for _ in range(100):  # the slow part is stopped by its own thread once it is up
        if len(stopped) == 2:
            break
        time.sleep(0.02)
    assert stopped == ["pool", "fleet"]
    with pytest.raises(PartNotStarted, match="trainer did not start"):
        start.parts["workers"].result()


def test_each_part_is_marked_ready_with_when_it_began(tmp_path):
    clock = StartupClock(from_process=False)
    clock.attach(tmp_path)
    start = StartTogether(clock)
    start.part("engines", lambda: time.sleep(0.15))
    start.part("sandboxes", lambda: None)
    start.wait()
    record = read_starts(tmp_path)[-1]
    phases, details = record["phases"], record["details"]
    assert phases["sandboxes_warm"] <= phases["engines_ready"]
    assert details["engines_ready"]["began"] <= phases["sandboxes_warm"]  # both began before either was up
    assert phases["engines_ready"] - details["engines_ready"]["began"] >= 0.15


def test_the_record_keeps_every_start_of_the_run(tmp_path):
    first = StartupClock(from_process=False)
    first.attach(tmp_path)
    first.mark("ray_up")
    first.mark("ray_up")  # a phase is when it was first reached
    first.mark("first_step_trained")
    resumed = StartupClock(from_process=False, resume=True)
    resumed.attach(tmp_path)
    resumed.mark("checkpoint_loaded")
    starts = json.loads((tmp_path / FILE).read_text())["starts"]
    assert [s["resume"] for s in starts] == [False, True]
    assert list(starts[0]["phases"]) == ["ray_up", "first_step_trained"]
    assert 0 <= starts[0]["phases"]["ray_up"] <= starts[0]["phases"]["first_step_trained"]
    assert list(starts[1]["phases"]) == ["checkpoint_loaded"] and starts[1]["origin"] == "clock"
    assert first.summary("first_step_trained").startswith("first step trained ")
    assert "after Ray was up" in first.summary("first_step_trained")


def test_the_driver_clock_counts_from_its_process_start():
    """A process that sleeps 0.5 s before making its clock: the clock's origin is the process start, so
    its first mark is past 0.5 s (a clock counting from its own creation would say about 0)."""
    code = ("import time; time.sleep(0.5); from rayrl.startup import StartupClock; c = StartupClock(); "
            "print(c.origin, c.mark('config_loaded'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    origin, offset = out.stdout.split()
    assert origin == "process" and 0.5 <= float(offset) < 30
    assert abs(process_start_time() - time.time()) < 24 * 3600
