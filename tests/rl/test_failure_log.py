"""Failed episodes are logged once per cause with their count (rayrl/rl/failure_log.py): the issue-43 run printed
the same 12-line traceback 16 times per step, trained nothing and exited 0; the ``one_cause_failures`` guard
(rayrl/rl/guards.py) stops such a run after its first step (the stop itself: tests/pipeline/test_guard_stop.py)."""

from __future__ import annotations

from rayrl.config import GuardsConfig
from rayrl.rl.failure_log import FailureLog, dominant_cause, error_signature
from rayrl.rl.guards import StepView, check_guards, read_crossings, write_crossings
from rayrl.types import Episode

TRACEBACK = """agent_crashed: exited with 1: Traceback (most recent call last):
  File "/tmp/user{n}/agent.py", line 31, in <module>
    reply = client.messages.create(model=model, max_tokens=256, temperature=0.7, messages=messages)
  File "/work/.venv/lib/python3.11/site-packages/anthropic/_utils/_utils.py", line 282, in wrapper
    return func(*args, **kwargs)
TypeError: Messages.create() got an unexpected keyword argument 'temperature' (object at 0x7f3a{n}c0)"""


def _crashed(n: int, error: str = TRACEBACK) -> Episode:
    return Episode(f"s0-{n:032x}", f"task-{n}", "g", reward=0.0, status="failed", failure="agent_crashed",
                   error=error.format(n=n))


def test_one_line_per_cause_with_its_count_and_the_whole_error_the_first_time():
    log = FailureLog()
    step1 = [_crashed(n) for n in range(16)] + [Episode("s9", "t9", "g", reward=1.0)]
    lines = log.lines(1, step1)
    assert len(lines) == 1
    assert lines[0].startswith("step 1: 16 episodes failed (agent_crashed; scored 0) e.g. session=s0-")
    assert lines[0].count("Traceback (most recent call last)") == 1 and lines[0].endswith("(object at 0x7f3a0c0)")
    again = log.lines(2, [_crashed(n) for n in range(100, 116)])
    assert again == ["step 2: 16 episodes failed (agent_crashed; scored 0) e.g. session=s0-" + f"{100:032x}"
                     " task=task-100, the same error as at step 1: TypeError: Messages.create() got an unexpected "
                     "keyword argument 'temperature' (object at 0x7f3a100c0)"]


def test_different_causes_are_apart_most_frequent_first():
    log = FailureLog()
    timeout = Episode("s1", "t1", "g", status="failed", failure="timed_out", error="timed_out: agent.py was still "
                                                                                 "running at the episode deadline")
    other = _crashed(1, "agent_crashed: exited with 1: KeyError: 'answer'")
    lines = log.lines(3, [timeout, _crashed(2), _crashed(3), other])
    assert [line.split(" e.g.")[0] for line in lines] == [
        "step 3: 2 episodes failed (agent_crashed; scored 0)", "step 3: 1 episode failed (timed_out; left out of "
        "training)", "step 3: 1 episode failed (agent_crashed; scored 0)"]
    assert error_signature(_crashed(4)) == error_signature(_crashed(5)) != error_signature(other)


def test_the_dominant_cause_of_a_step():
    every = dominant_cause([_crashed(n) for n in range(16)])
    assert every.share == 1.0 and every.count == 16 and every.example.task_id == "task-0"
    assert every.cause == ("agent_crashed: TypeError: Messages.create() got an unexpected keyword argument "
                           "'temperature' (object at 0x7f3a0c0)")
    one_line = _crashed(1, "agent_crashed: KeyError: 'answer'")
    mixed = dominant_cause([_crashed(2), _crashed(3), one_line, Episode("s", "t", "g", reward=1.0)])
    assert mixed.share == 0.5 and mixed.count == 4 and mixed.example.task_id == "task-2"
    assert dominant_cause([one_line]).cause == "agent_crashed: KeyError: 'answer'"  # the kind is said once
    assert dominant_cause([Episode("s", "t", "g")]).share == 0.0


def test_the_guard_stops_a_step_whose_every_episode_failed_the_same_way(tmp_path):
    def crossings(episodes, cfg=None):
        report = check_guards(StepView(episodes), cfg or GuardsConfig(), step=1,
                              episodes_file="runs/x/episodes/step000001.jsonl")
        return report, {c.guard: c for c in report.crossings}

    report, by_guard = crossings([_crashed(n) for n in range(16)])
    assert report.metrics["guards/one_cause_failure_rate"] == 1.0
    stop = report.stop
    assert stop is not None and stop.guard == "one_cause_failures" and by_guard.keys() == {"one_cause_failures"}
    assert stop.line() == (
        "[rayrl] guard one_cause_failures at step 1: 1.00 of 16 episodes failed for one cause (agent_crashed: "
        "TypeError: Messages.create() got an unexpected keyword argument 'temperature' (object at 0x7f3a0c0)), "
        f"above its threshold 0.99; e.g. episode s0-{0:032x} (task task-0, runs/x/episodes/step000001.jsonl, "
        "line 1); stopping the run")
    write_crossings(tmp_path, report.crossings)
    assert read_crossings(tmp_path)[0]["detail"].startswith("agent_crashed: TypeError")  # for the inspector
    one_ok = [_crashed(n) for n in range(15)] + [Episode("s", "t", "g", reward=1.0)]
    assert "one_cause_failures" not in crossings(one_ok)[1]  # something trains
    two_causes = [_crashed(n) for n in range(8)] + [_crashed(n, "agent_crashed: KeyError: 'a'") for n in range(8)]
    assert crossings(two_causes)[0].metrics["guards/one_cause_failure_rate"] == 0.5
    assert "one_cause_failures" not in crossings(two_causes)[1]
    assert "one_cause_failures" not in crossings([_crashed(n) for n in range(3)])[1]  # 3 episodes: no verdict
    warn = crossings([_crashed(n) for n in range(4)], GuardsConfig(one_cause_failures="warn"))[1]
    assert warn["one_cause_failures"].action == "warn"
