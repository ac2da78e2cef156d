"""What a schedule, the engine membership and the run's checkpoints drive, as protocols.

actors/ implements each with a Ray shell (named beside each protocol); tests/orchestration/test_schedule_phases.py
implements them with plain fakes, so the phase order of every schedule, the rerun and drop rules and the
way back after a trainer failure are tested in milliseconds without Ray.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

from rayrl.config import RunConfig
from rayrl.data import TaskSampler
from rayrl.rl.groups import Group
from rayrl.types import Sample, Task

if TYPE_CHECKING:  # the weight path imports torch; the schedules only name its types
    from rayrl.weights.plan import EngineEndpoint, RankPlace, WeightPlan


@dataclass
class RunState:
    """What every part of the loop reads and the schedule advances: step, policy version, group ids,
    failures by kind (cumulative), and the groups set aside during the current step (run again or dropped
    as stale) whose episodes the pipeline still has to record."""

    step: int = 0
    version: int = 0
    group_seq: int = 0  # groups ever queued; part of each group id
    failures: Counter = field(default_factory=Counter)
    episodes: int = 0  # episodes of every group queued, reruns and dropped ones too, counted when queued
    # (pipeline.episode_budget; episodes retried inside a group after a worker death are not counted)
    set_aside: list[Group] = field(default_factory=list)


class Dispatcher(Protocol):
    """Keeps groups of episodes moving on the rollout workers (actors/dispatch.py GroupDispatcher)."""

    @property
    def groups_in_flight(self) -> int: ...

    def submit(self, task: Task, group_id: str, front: bool = False, reruns: int = 0) -> None: ...

    def poll(self, timeout: float) -> int: ...

    def take(self, n: int) -> list[Group]: ...

    def fail_unfinished(self, reason: str) -> list[Group]: ...

    def restore(self, rows: list[dict[str, Any]]) -> None: ...

    def untrained_tasks(self) -> list[dict[str, Any]]: ...


class Trainer(Protocol):
    """The trainer's ranks as one (actors/trainer.py TrainerGroup)."""

    @property
    def full_state_on_every_rank(self) -> bool: ...

    def train(self, samples: list[Sample], advantages: Sequence[Any]) -> dict[str, Any]: ...

    def onload(self) -> bool: ...

    def offload(self) -> bool: ...

    def places(self) -> list[RankPlace]: ...

    def connect_weights(self, plan: WeightPlan, disk_root: str, timeout_s: float) -> None: ...

    def push_weights(self, dtype: str) -> list[Any]: ...

    def gather(self, phase: str, refs: Sequence[Any], **kwargs: Any) -> list[Any]: ...

    def close_weights(self) -> None: ...

    def save_checkpoint(self, directory: str, from_rank: Optional[int] = None, store: Any = None,
                        step: int = 0) -> None: ...

    def load_checkpoint(self, directory: str, store: Any = None, step: int = 0) -> int: ...

    def unseen_by(self, path: str) -> list[int]: ...


class EngineSlotView(Protocol):
    """One engine's place as the membership reads it (actors/engine_fleet.py EngineSlot)."""

    index: int
    state: str  # starting | joining | live | down
    info: dict[str, Any]

    @property
    def url(self) -> str: ...


class EngineEventView(Protocol):
    """What a fleet poll saw (actors/engine_fleet.py EngineEvent)."""

    kind: str  # down | started
    index: int
    url: str
    detail: str


class Engines(Protocol):
    """The engines: who is up (poll, refresh, mark_live, endpoints: only the membership calls these) and
    the control calls fanned out to the live ones (actors/engine_fleet.py EngineFleet)."""

    slots: Sequence[Any]

    @property
    def urls(self) -> list[str]: ...

    def poll(self, start_replacements: bool = True) -> Sequence[Any]: ...

    def refresh(self) -> None: ...

    def mark_live(self, index: int) -> None: ...

    def endpoints(self) -> list[EngineEndpoint]: ...

    def pause_generation(self, mode: str) -> None: ...

    def wait_idle(self) -> None: ...

    def continue_generation(self) -> None: ...

    def release_memory_occupation(self) -> None: ...

    def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None: ...


class Weights(Protocol):
    """Trainer -> engines weight updates to the endpoints it is given (actors/weight_sync.py WeightSync):
    ``push`` raises WeightSyncError when the engines' side fails (rayrl/orchestration/part_failures.py).
    ``adapter_only``: the updates are a LoRA adapter (trainer.lora), which engines need even at policy
    version 0 (requests name it)."""

    adapter_only: bool

    def connect(self, endpoints: list[EngineEndpoint]) -> Optional[WeightPlan]: ...

    def push(self, version: int, endpoints: list[EngineEndpoint]) -> dict[str, Any]: ...

    def release_groups(self) -> None: ...


class Gateway(Protocol):
    """The gateway shards' routers: where LLM calls go and whether they wait (actors/gateway_shard.py
    GatewayShards)."""

    def set_engines(self, urls: list[str]) -> None: ...

    def hold_llm_calls(self) -> None: ...

    def release_llm_calls(self) -> None: ...

    def drain(self, timeout_s: float) -> bool: ...

    def queue_depth(self) -> int: ...


@dataclass
class RunParts:
    """The pieces a schedule drives (actors/pipeline.py builds them from the Ray shells)."""

    cfg: RunConfig
    state: RunState
    sampler: TaskSampler
    dispatcher: Dispatcher
    trainer: Trainer
    engines: Engines
    weights: Weights
    gateway: Gateway
