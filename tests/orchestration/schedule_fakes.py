"""Plain fakes for the Ray shells the schedules drive (rayrl/orchestration/parts.py), shared by the
orchestration tests (test_schedule_phases.py, test_episode_budget.py).

The fakes stand in for actors/dispatch.py, actors/trainer.py, actors/engine_fleet.py, actors/weight_sync.py
and actors/gateway_shard.py and keep their contracts as the schedules see them: the dispatcher completes a
queued group at its next poll with episodes whose tokens carry the policy version of that moment, the
trainer's step advances the version by one, the fleet reports engines going down and coming back as events.
Each fake writes what it is asked to one shared log, so a test reads the exact order of calls across
trainer, engines, weights and gateway. They also keep the memory rules of the GPU: an offloaded trainer
cannot be saved, loaded or pushed from (the CPU stand-in rayrl/trainers/memory_standin.py raises, a GPU
reads unmapped memory); an engine that released its memory lost its weights until a push (SGLang 0.5.9
without ``enable_weights_cpu_backup``); an episode that reaches an engine without its weights fails the test.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from rayrl.config import load_config
from rayrl.data import TaskSampler
from rayrl.orchestration.groups_in_flight import GroupsInFlight
from rayrl.orchestration.part_failures import TrainerFailure, WeightSyncError
from rayrl.orchestration.parts import RunParts, RunState
from rayrl.orchestration.schedules import make_schedule
from rayrl.resolve import resolve
from rayrl.rl.batch import build_batch
from rayrl.rl.failures import fail
from rayrl.rl.groups import Group
from rayrl.types import Episode, Sample, Task

Outcome = Callable[[Group, int], Episode]  # (group, episode index) -> the episode as it came back
STARTED_ON: dict[str, int] = {}  # group id -> the policy version its episodes started on (the fake's record)


def scored_by_index(group: Group, index: int) -> Episode:
    """Rewards 0, 1, 0, 1, ... within a group: every group varies, so every group trains."""
    return _episode(group, float(index % 2))


def _episode(group: Group, reward: float, failure: Optional[str] = None) -> Episode:
    version = STARTED_ON[group.group_id]
    sample = Sample(tokens=[1, 2, 3, 4], prompt_length=2, loss_mask=[1, 1], rollout_logprobs=[-1.0, -1.0],
                    policy_versions=[version, version])
    episode = Episode(session_id="s", task_id=group.task.task_id, group_id=group.group_id, samples=[sample],
                      reward=reward)
    return fail(episode, failure, "on purpose") if failure else episode


class Unmapped(AssertionError):
    """What the fakes raise where the GPU would read or write memory that is not there."""


class Log(list):
    def since(self, mark: int) -> list[str]:
        return list(self[mark:])


class FakeDispatcher(GroupsInFlight):
    """GroupDispatcher's contract, on the real bookkeeping of the groups in flight (the GroupsInFlight
    it extends too): a queued group starts at the next poll (on that poll's policy version) and completes
    there, in-process instead of on rollout workers; ``stalled`` groups never complete (a step deadline
    test)."""

    def __init__(self, log: Log, group_size: int, outcome: Outcome = scored_by_index) -> None:
        super().__init__(group_size)
        self.log = log
        self.state = RunState()  # the run's (make_run sets it): the policy version a group starts on
        self.outcome = outcome
        self.engines: Optional[FakeEngines] = None  # (make_run) whose weights a group's episodes are served by
        self.gateway: Optional[FakeGateway] = None
        self.stalled = False
        self.stalled_tasks: set[str] = set()  # groups of these tasks never complete
        self.submitted: list[tuple[str, str, bool, int]] = []  # (group id, task id, front, reruns)

    def submit(self, task: Task, group_id: str, front: bool = False, reruns: int = 0) -> None:
        super().submit(task, group_id, front, reruns)
        self.submitted.append((group_id, task.task_id, front, reruns))

    def poll(self, timeout: float) -> int:
        if self.queue and self.engines is not None and not (self.gateway and self.gateway.holding):
            self.engines.check_serving()  # the episodes' LLM calls reach the engines now
        while self.queue:
            group = self.queue.popleft()
            STARTED_ON[group.group_id] = self.state.version
            self.active[group.group_id] = group
        if self.stalled:
            return 0
        done = [g for g in self.active.values() if g.task.task_id not in self.stalled_tasks]
        for group in done:
            group.episodes = {i: self.outcome(group, i) for i in range(group.size)}
            del self.active[group.group_id]
            self.completed.append(group)
        return len(done)

    def fail_unfinished(self, reason: str) -> list[Group]:
        groups = list(self.active.values())
        if groups and self.engines is not None:  # cancelled episodes' LLM calls may still run at the engines
            self.engines.batch_may_hold_requests = True
        for group in groups:
            group.episodes = {i: fail(Episode("", group.task.task_id, group.group_id), "step_deadline",
                                      reason) for i in range(group.size)}
        self.active.clear()
        return groups


class FakeTrainer:
    """TrainerGroup's contract: train advances the policy version by one; a checkpoint is a file holding
    the version; ``fail_in`` raises TrainerFailure in that phase (``survivors``: rank -> version)."""

    full_state_on_every_rank = True

    def __init__(self, log: Log) -> None:
        self.log = log
        self.version = 0
        self.fail_in: Optional[str] = None
        self.survivors: dict[int, int] = {}
        self.during_train: Callable[[], None] = lambda: None
        self.saved_from: list[Optional[int]] = []
        self.offloaded = False

    def live_memory(self, what: str) -> None:
        if self.offloaded:
            raise Unmapped(f"{what} of an offloaded trainer")

    def _maybe_fail(self, phase: str) -> None:
        if self.fail_in == phase:
            raise TrainerFailure(phase, {0: "ActorDiedError: on purpose"}, dict(self.survivors))

    def train(self, samples: list[Sample], advantages: Sequence[Any]) -> dict[str, Any]:
        self.log.append(f"trainer.train({len(samples)})")
        self.live_memory("train")
        self._maybe_fail("train")
        self.during_train()
        self.version += 1
        return {"policy_version": self.version, "loss": 0.0}

    def onload(self) -> bool:
        self.log.append("trainer.onload")
        self.offloaded = False
        return True

    def offload(self) -> bool:
        self.log.append("trainer.offload")
        self._maybe_fail("offload")
        self.offloaded = True
        return True

    def save_checkpoint(self, directory: str, from_rank: Optional[int] = None, store: Any = None,
                        step: int = 0) -> None:
        self.log.append("trainer.save_checkpoint")
        self.live_memory("save_checkpoint")
        self._maybe_fail("checkpoint")
        Path(directory).mkdir(parents=True, exist_ok=True)
        version = self.survivors.get(from_rank, self.version) if from_rank is not None else self.version
        (Path(directory) / "trainer.txt").write_text(str(version))
        self.saved_from.append(from_rank)

    def load_checkpoint(self, directory: str, store: Any = None, step: int = 0) -> int:
        self.log.append("trainer.load_checkpoint")
        self.live_memory("load_checkpoint")
        self.version = int((Path(directory) / "trainer.txt").read_text())
        return self.version

    def unseen_by(self, path: str) -> list[int]:
        return [] if Path(path).exists() else [0]


class FakeSlot:
    def __init__(self, index: int) -> None:
        self.index, self.state, self.info = index, "live", {"url": f"http://e{index}", "node_id": "n0"}
        self.released: set[str] = set()  # memory tags released
        self.weights_lost = False  # released without a CPU backup, not pushed to since

    @property
    def url(self) -> str:
        return self.info["url"]


@dataclasses.dataclass(frozen=True)
class FakeEvent:
    kind: str
    index: int
    url: str
    detail: str = ""


class FakeEngines:
    """EngineFleet's contract: ``down(i)`` is what its watch would report; an engine that ``dies(i)`` is
    seen down only at the next refresh or poll (its watch returns then); a replacement starts only on a
    poll that allows it; control calls are logged. Its endpoints are the engines' URLs (the membership
    only compares them and hands them to the weight sync)."""

    def __init__(self, log: Log, n: int = 2) -> None:
        self.log = log
        self.slots = [FakeSlot(i) for i in range(n)]
        self.events: list[FakeEvent] = []
        self.waiting: list[int] = []  # down, their replacement starts at the next poll that allows it
        self.dying: list[int] = []  # died, not yet seen
        self.polls_refusing = 0
        self.batch_may_hold_requests = False  # after a pause, until a flush succeeds (SGLang: aborted requests
        # leave the batch at the scheduler's next step; in_place keeps them)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.slots if s.state == "live"]

    def endpoints(self) -> list[str]:
        return [s.url for s in self.slots if s.state in ("live", "joining")]

    def down(self, index: int) -> None:
        slot = self.slots[index]
        self.events.append(FakeEvent("down", index, slot.url, "actor died: on purpose"))
        slot.state = "down"
        self.waiting.append(index)

    def dies(self, index: int) -> None:
        self.dying.append(index)

    def refresh(self) -> None:
        for index in self.dying:
            self.down(index)
        self.dying = []

    def poll(self, start_replacements: bool = True) -> list[FakeEvent]:
        self.refresh()
        if not start_replacements:
            self.polls_refusing += int(bool(self.waiting))
        else:
            for index in self.waiting:
                slot = self.slots[index]
                slot.state, slot.info = "joining", {"url": f"http://e{index}-new", "node_id": "n1"}
                slot.released, slot.weights_lost = set(), False  # a new server, the checkpoint's weights
                self.events.append(FakeEvent("started", index, slot.url))
            self.waiting = []
        events, self.events = self.events, []
        return events

    def mark_live(self, index: int) -> None:
        self.log.append(f"fleet.mark_live({index})")
        self.slots[index].state = "live"

    def pause_generation(self, mode: str) -> None:
        self.log.append(f"engines.pause_generation({mode})")
        self.batch_may_hold_requests = True

    def wait_idle(self) -> None:
        self.log.append("engines.wait_idle")
        self.batch_may_hold_requests = False

    def needs_idle(self, what: str) -> None:
        if self.batch_may_hold_requests:
            raise Unmapped(f"{what} while requests may still run (after a pause, or episodes a deadline cut): "
                           "SGLang asserts no request is running")

    def continue_generation(self) -> None:
        self.log.append("engines.continue_generation")

    def release_memory_occupation(self) -> None:
        self.log.append("engines.release_memory_occupation")
        self.needs_idle("release_memory_occupation")
        for slot in self.slots:
            if slot.state == "live":
                slot.released, slot.weights_lost = set(TAGS), True

    def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        self.log.append(f"engines.resume_memory_occupation({','.join(tags) if tags else 'all'})")
        for slot in self.slots:
            if slot.state == "live":
                slot.released -= set(tags or TAGS)

    def take_weights(self, endpoints: list[str]) -> None:
        """A push reached ``endpoints``: they hold the trainer's weights (into memory they have); SGLang
        flushes the cache after the update and asserts that the flush succeeded."""
        self.needs_idle("a weight update with flush_cache")
        for slot in self.slots:
            if slot.url in endpoints:
                if "weights" in slot.released:
                    raise Unmapped(f"weights pushed to engine {slot.index} while its weights memory is released")
                slot.weights_lost = False

    def check_serving(self) -> None:
        """Every live engine can generate: its memory is back and its weights are not lost."""
        for slot in self.slots:
            if slot.state == "live" and (slot.released or slot.weights_lost):
                raise Unmapped(f"rollout on engine {slot.index} with {sorted(slot.released) or 'no'} memory "
                               f"released{' and its weights lost' if slot.weights_lost else ''}")


TAGS = ("weights", "kv_cache", "cuda_graph")


class FakeWeights:
    """WeightSync's contract: push reads the trainer's weights (live memory only) and sends the version to
    the endpoints it is given; a failure on the engines' side is WeightSyncError. ``fail_push``: that many
    pushes fail (``during_push`` runs first)."""

    def __init__(self, log: Log, trainer: FakeTrainer, engines: FakeEngines) -> None:
        self.log = log
        self.trainer = trainer
        self.engines = engines
        self.fail_push = 0
        self.during_push: Callable[[], None] = lambda: None
        self.adapter_only = False

    def connect(self, endpoints: list[str]) -> None:
        self.log.append("weights.connect")

    def push(self, version: int, endpoints: list[str]) -> dict[str, Any]:
        self.log.append(f"weights.push({version} -> {len(endpoints)})")
        self.trainer.live_memory("weight push")
        self.during_push()
        if self.fail_push:
            self.fail_push -= 1
            raise WeightSyncError("weight update failed on purpose")
        self.engines.take_weights(endpoints)
        return {"bytes": 1, "seconds": 0.0, "senders": len(endpoints)}

    def release_groups(self) -> None:
        self.log.append("weights.release_groups")


class FakeGateway:
    """GatewayShards as the schedules see it: the routers' engine list and their call holding."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.drained = True
        self.holding = False
        self.routed: list[list[str]] = []

    def set_engines(self, urls: list[str]) -> None:
        self.log.append(f"gateway.set_engines({' '.join(urls)})")
        self.routed.append(list(urls))

    def hold_llm_calls(self) -> None:
        self.log.append("gateway.hold_llm_calls")
        self.holding = True

    def release_llm_calls(self) -> None:
        self.log.append("gateway.release_llm_calls")
        self.holding = False

    def drain(self, timeout_s: float) -> bool:
        self.log.append("gateway.drain")
        return self.drained

    def queue_depth(self) -> int:
        return 0


@dataclasses.dataclass
class Run:
    log: Log
    parts: RunParts
    dispatcher: FakeDispatcher
    trainer: FakeTrainer
    engines: FakeEngines
    weights: FakeWeights
    gateway: FakeGateway
    schedule: Any

    @property
    def state(self) -> RunState:
        return self.parts.state

    def step(self, counts: Optional[Counter] = None) -> tuple[list[Group], Optional[dict[str, Any]]]:
        """What actors/pipeline.py's run_step does around the schedule: collect, batch, train."""
        self.state.step += 1
        groups = self.schedule.collect(counts if counts is not None else Counter())
        batch = build_batch([e for g in groups for e in g.ordered()], self.parts.cfg.algorithm)
        train = self.schedule.train(batch) if batch.trains else None
        return groups, train


def make_run(*overrides: str, outcome: Outcome = scored_by_index, tasks: int = 32, engines: int = 2) -> Run:
    cfg = resolve(load_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=2", *overrides]))
    STARTED_ON.clear()
    log = Log()
    dataset = [Task(f"prompt {i}", task_id=f"t{i}") for i in range(tasks)]  # what FileDataset indexes to
    sampler = TaskSampler(dataset, shuffle=False)  # type: ignore[arg-type]
    dispatcher = FakeDispatcher(log, cfg.rollout.group_size, outcome)
    fleet = FakeEngines(log, engines)
    trainer, gateway = FakeTrainer(log), FakeGateway(log)
    weights = FakeWeights(log, trainer, fleet)
    parts = RunParts(cfg, RunState(), sampler, dispatcher, trainer, fleet, weights, gateway)
    dispatcher.state, dispatcher.engines, dispatcher.gateway = parts.state, fleet, gateway
    if cfg.pipeline.schedule == "colocated_async":  # actors/pipeline.py: while the trainer is built
        fleet.release_memory_occupation()
        log.clear()
    return Run(log, parts, dispatcher, trainer, fleet, weights, gateway, make_schedule(parts))
