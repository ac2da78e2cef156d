"""EngineFleet: the driver's handle over every EngineActor, and the replacement of engines that die.

Engines start in parallel (each actor starts its own server on its own node). The fleet keeps one
pending ``watch()`` per engine; when one returns (the server exited) or fails (the actor died), the
engine is down: :meth:`EngineFleet.poll` reports it, the fleet kills what is left of the actor and
creates a new one on the same placement bundle (at once, or when the caller allows it: a colocated
engine's GPU may be lent to the trainer). The new engine is *not* live until the caller has given
it the current weights and calls :meth:`EngineFleet.mark_live` (actors/pipeline.py: routers learn its
address only then), so no call ever reaches an engine with stale weights.

Control calls (pause, memory, stats) fan out to the live engines concurrently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

import ray

from actors.engine import EngineActor, EngineSeat
from rayrl.config import EngineConfig
from rayrl.weights.routes import EngineEndpoint

logger = logging.getLogger("rayrl.engines")

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_FAILED_STARTS = 3  # replacements in a row that fail to start before the run gives up on an engine


class EngineStartError(RuntimeError):
    """An engine could not be started again after it died; the message carries the last cause."""


@dataclass
class EngineSlot:
    """One engine's place: its seat (bundles) and the actor now in it."""

    index: int
    seat: Optional[EngineSeat]
    actor: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    state: str = "starting"  # starting | joining (started, waiting for weights) | live | down
    watch: Any = None  # the pending watch() ref
    start_ref: Any = None  # the pending info() ref of a (re)starting actor
    restarts: int = 0
    failed_starts: int = 0  # replacements in a row that failed to start

    @property
    def url(self) -> str:
        return str(self.info.get("url", ""))


@dataclass(frozen=True)
class EngineEvent:
    """What :meth:`EngineFleet.poll` saw: an engine went ``down`` (with its old URL) or ``started``."""

    kind: str  # down | started
    index: int
    url: str
    detail: str = ""


class EngineFleet:
    """N engine actors, one per seat (bundle set), started together, replaced one by one."""

    def __init__(self, cfg: EngineConfig, model_path: str, log_dir: str, seats: list[Optional[EngineSeat]],
                 name_prefix: str = "rayrl") -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.log_dir = log_dir
        self.name_prefix = name_prefix
        self.slots = [EngineSlot(i, seat) for i, seat in enumerate(seats)]
        self._events: list[EngineEvent] = []  # seen by refresh(), not yet handed out by poll()
        for slot in self.slots:
            self._create(slot)
        try:
            infos = ray.get([slot.start_ref for slot in self.slots])
        except Exception:
            self.shutdown()
            raise
        for slot, info in zip(self.slots, infos):
            self._started(slot, info)
            slot.state = "live"
        try:
            self._check_reachable()
        except Exception:
            self.shutdown()
            raise

    # -- lifecycle -----------------------------------------------------------------------------------

    def _actor_options(self, slot: EngineSlot) -> dict[str, Any]:
        options: dict[str, Any] = {"name": f"{self.name_prefix}-engine-{slot.index}-r{slot.restarts}"}
        if slot.seat is not None:
            options.update(slot.seat.actor_options())
        elif self.cfg.backend == "sglang":  # no shared placement: Ray still accounts for each GPU
            options["num_gpus"] = self.cfg.tp_size
        return options

    def _create(self, slot: EngineSlot) -> None:
        slot.actor = EngineActor.options(**self._actor_options(slot)).remote(
            self.cfg, self.model_path, self.log_dir, slot.index, slot.seat)
        slot.start_ref = slot.actor.info.remote()
        slot.state = "starting"

    def _check_reachable(self) -> None:
        """An engine bound to loopback on another machine than the driver cannot be reached by the gateway
        (which runs on the driver's node): say which field to set instead of failing every LLM call."""
        here = ray.util.get_node_ip_address()
        for slot in self.slots:
            host = urlsplit(slot.url).hostname or ""
            if host in LOOPBACK and slot.info.get("node_ip") != here:
                raise RuntimeError(
                    f"engine.host: {self.cfg.host} binds engine {slot.index} to loopback on {slot.info.get('node_ip')}, "
                    f"which the gateway on {here} cannot reach; set engine.host: 0.0.0.0 when engines run on other "
                    "machines (docs/multinode.md)")

    def _started(self, slot: EngineSlot, info: dict[str, Any]) -> None:
        slot.info = info
        slot.start_ref = None
        slot.watch = slot.actor.watch.remote()

    def poll(self, start_replacements: bool = True) -> list[EngineEvent]:
        """Engines that went down since the last poll and replacements that have started (state
        ``joining``: they need the current weights, then :meth:`mark_live`). A dead engine's replacement is
        created in its seat now, or, with ``start_replacements`` False (its GPU is lent to the trainer),
        at the first poll that allows it."""
        self.refresh()
        if start_replacements:
            for slot in self.slots:
                if slot.state == "down":
                    self._create(slot)
        events, self._events = self._events, []
        return events

    def refresh(self) -> None:
        """Bring the slots' states up to date without handing out the events (the next :meth:`poll` does)."""
        events = self._events
        watching = {slot.watch: slot for slot in self.slots if slot.watch is not None}
        if watching:
            done, _ = ray.wait(list(watching), num_returns=len(watching), timeout=0)
            for ref in done:
                slot = watching[ref]
                try:
                    detail = f"server exited with code {ray.get(ref)}"
                except Exception as err:  # RayActorError: the actor itself died (killed, node lost)
                    detail = f"actor died: {type(err).__name__}"
                events.append(EngineEvent("down", slot.index, slot.url, detail))
                self._retire(slot)
        starting = {slot.start_ref: slot for slot in self.slots if slot.start_ref is not None}
        if starting:
            done, _ = ray.wait(list(starting), num_returns=len(starting), timeout=0)
            for ref in done:
                slot = starting[ref]
                try:
                    info = ray.get(ref)
                except Exception as err:  # the replacement failed to start: try again, a few times
                    slot.failed_starts += 1
                    if slot.failed_starts >= MAX_FAILED_STARTS:
                        raise EngineStartError(f"engine {slot.index} failed to start {slot.failed_starts} times "
                                               f"in a row; last: {err}") from None
                    logger.error("engine %d failed to start again: %s", slot.index, err)
                    self._retire(slot)
                    continue
                slot.failed_starts = 0
                self._started(slot, info)
                slot.state = "joining"
                events.append(EngineEvent("started", slot.index, slot.url))

    def _retire(self, slot: EngineSlot) -> None:
        """Kill what is left of the slot's actor (its server dies with it); the seat waits for a new one."""
        slot.state = "down"
        slot.watch = None
        slot.start_ref = None
        try:
            ray.kill(slot.actor)
        except Exception:  # already gone
            pass
        slot.restarts += 1
        logger.warning("engine %d (%s) is down; a new one will start on its bundle", slot.index, slot.url)

    def mark_live(self, index: int) -> None:
        self.slots[index].state = "live"

    # -- where they are ------------------------------------------------------------------------------

    def live(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.state == "live"]

    @property
    def urls(self) -> list[str]:
        """URLs of the live engines."""
        return [s.url for s in self.live()]

    def endpoints(self, states: tuple[str, ...] = ("live", "joining")) -> list[EngineEndpoint]:
        """Where the engines serve (for the weight routes): live ones and those waiting for weights."""
        return [EngineEndpoint(s.url, s.info["node_id"], self.cfg.tp_size, tuple(s.info.get("bundles", ())))
                for s in self.slots if s.state in states]

    def infos(self) -> list[dict[str, Any]]:
        return [dict(s.info, state=s.state, restarts=s.restarts) for s in self.slots]

    # -- control, fanned out -------------------------------------------------------------------------

    def _all(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> list[Any]:
        slots = self.live()
        return ray.get([getattr(s.actor, method).remote(*args) for s in slots], timeout=timeout_s)

    def pause_generation(self, mode: str) -> None:
        self._all("pause_generation", mode)

    def continue_generation(self) -> None:
        self._all("continue_generation")

    def release_memory_occupation(self) -> None:
        self._all("release_memory_occupation", None)

    def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """``tags``: what comes back (None: everything); the colocated schedule brings the weights back
        first, the KV cache and CUDA graphs once the trainer has given its memory back."""
        self._all("resume_memory_occupation", list(tags) if tags is not None else None)

    def set_weight_format(self, weight_format: str) -> int:
        """Every CPU engine's decode weights from now on, replacements included (SGLang has none); returns
        how many engines changed."""
        if self.cfg.backend == "sglang":
            return 0
        self.cfg = replace(self.cfg, weight_format=weight_format)
        return sum(self._all("set_weight_format", weight_format))

    def weight_versions(self) -> dict[int, str]:
        slots = self.live()
        return dict(zip([s.index for s in slots], ray.get([s.actor.weight_version.remote() for s in slots])))

    def work_stats(self) -> dict[str, dict[str, float]]:
        """Cumulative counters per live engine, keyed ``"<index>:<incarnation>"``: a replaced engine's
        counters start again at 0 under a new key."""
        slots = self.live()
        keys = [f"{s.index}:{s.info.get('incarnation', '')}" for s in slots]
        return dict(zip(keys, ray.get([s.actor.work_stats.remote() for s in slots])))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        actors = [s.actor for s in self.slots if s.actor is not None]
        try:
            ray.get([a.shutdown.remote() for a in actors], timeout=timeout_s)
        except Exception as err:  # an engine that already died cannot be stopped politely
            logger.warning("engine shutdown incomplete: %s", err)
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
