"""EngineFleet: the driver's handle over every EngineActor, and the replacement of engines that die.

Engines start in parallel (each actor starts its own server on its own node). The fleet keeps one
pending ``watch()`` per engine; when one returns (the server exited) or fails (the actor died), the
engine is down: :meth:`EngineFleet.poll` reports it once, the fleet kills what is left of the actor and
creates a new one on the same placement bundle once Ray has that bundle on a live node (a probe task
on the bundle returns; when the node died, that is after Ray has placed the bundle again, on a spare
node, which may never come) and when the caller allows it (a colocated engine's GPU may be lent to the
trainer). So a node's death is one restart, counted once, and never a replacement queued on a node that
is gone. The new engine is *not* live until the engine membership (rayrl/orchestration/membership.py, the
one caller of :meth:`EngineFleet.poll` and :meth:`EngineFleet.mark_live`) has given it the current
weights and marked it live; the routers learn its address only then, so no call ever reaches an engine
with stale weights. Shutdown stops the engines that are up and only kills the rest: it never waits on an
engine that cannot be placed.

Control calls (pause, memory, stats) fan out to the live engines concurrently; one whose actor died
meanwhile is left out of the answers, not raised: its watch reports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

import ray

from actors.engine import EngineActor, EngineSeat, bundle_probe
from rayrl.config import EngineConfig
from rayrl.engines.backends import engine_backend
from rayrl.weights.plan import EngineEndpoint

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
    restarts: int = 0  # times its engine went down (each one replacement)
    failed_starts: int = 0  # replacements in a row that failed to start
    placed: Optional[list[Any]] = None  # pending probes of the seat's bundles while it is down

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
        tries = f"-s{slot.failed_starts}" if slot.failed_starts else ""  # one name per start
        options: dict[str, Any] = {"name": f"{self.name_prefix}-engine-{slot.index}-r{slot.restarts}{tries}"}
        if slot.seat is not None:
            options.update(slot.seat.actor_options())
        elif engine_backend(self.cfg.backend).on_gpu:  # no shared placement: Ray still accounts for each GPU
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
                    f"engine.host: {self.cfg.host} binds engine {slot.index} to loopback on "
                    f"{slot.info.get('node_ip')}, "
                    f"which the gateway on {here} cannot reach; set engine.host: 0.0.0.0 when engines run on other "
                    "machines (docs/multinode.md)")

    def _started(self, slot: EngineSlot, info: dict[str, Any]) -> None:
        slot.info = info
        slot.start_ref = None
        slot.watch = slot.actor.watch.remote()

    def poll(self, start_replacements: bool = True) -> list[EngineEvent]:
        """Engines that went down since the last poll and replacements that have started (state
        ``joining``: they need the current weights, then :meth:`mark_live`). A dead engine's replacement is
        created in its seat once Ray has the seat's bundles on a live node and ``start_replacements``
        allows it (False while its GPU is lent to the trainer)."""
        self.refresh()
        if start_replacements:
            for slot in self.slots:
                if slot.state == "down" and self._placed(slot):
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
                    detail = f"server exited with code {ray.get(ref)}; its log: {slot.info.get('log_path', '?')}"
                except Exception as err:  # RayActorError: the actor itself died (killed, node lost)
                    detail = f"actor died: {type(err).__name__}"
                events.append(EngineEvent("down", slot.index, slot.url, detail))
                slot.restarts += 1
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
                    logger.error("engine %d failed to start again (%d of %d tries): %s", slot.index,
                                 slot.failed_starts, MAX_FAILED_STARTS, str(err).strip().splitlines()[0])
                    self._retire(slot)
                    continue
                slot.failed_starts = 0
                self._started(slot, info)
                slot.state = "joining"
                events.append(EngineEvent("started", slot.index, slot.url))

    def _retire(self, slot: EngineSlot) -> None:
        """Kill what is left of the slot's actor (its server dies with it); the seat waits for a new one,
        which starts once its bundles are on a live node (a probe on each, started now)."""
        slot.state = "down"
        slot.watch = None
        slot.start_ref = None
        try:
            ray.kill(slot.actor)
        except Exception:  # already gone
            pass
        if slot.seat is not None:
            # retried without end: a probe whose node dies waits, as the bundle does, to be placed again
            slot.placed = [bundle_probe.options(scheduling_strategy=slot.seat.strategy(b),
                                                max_retries=-1).remote() for b in slot.seat.bundles]

    def _placed(self, slot: EngineSlot) -> bool:
        """Whether the seat's bundles are on live nodes (every probe has run); a seat without a
        placement group is always ready."""
        if not slot.placed:
            return True
        done, _ = ray.wait(slot.placed, num_returns=len(slot.placed), timeout=0)
        if len(done) < len(slot.placed):
            return False
        try:
            ray.get(done)
        except Exception as err:  # the probe itself failed (the group was removed): probe again
            logger.debug("engine %d: bundle probe failed (%s); probing again", slot.index, err)
            self._retire(slot)
            return False
        slot.placed = None
        return True

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
        """Where the engines serve (for the weight plan): live ones and those waiting for weights."""
        return [EngineEndpoint(s.url, s.info["node_id"], self.cfg.tp_size, tuple(s.info.get("bundles", ())))
                for s in self.slots if s.state in states]

    def infos(self) -> list[dict[str, Any]]:
        return [dict(s.info, state=s.state, restarts=s.restarts) for s in self.slots]

    # -- control, fanned out -------------------------------------------------------------------------

    def _each(self, method: str, *args: Any) -> list[tuple[EngineSlot, Any]]:
        """``method(*args)`` on every live engine at once: ``(slot, answer)`` of those that answered. An
        engine whose actor died meanwhile (its node lost) is left out; its watch reports it at the next
        poll, which counts and replaces it once."""
        slots = self.live()
        refs = [getattr(s.actor, method).remote(*args) for s in slots]
        answered = []
        for slot, ref in zip(slots, refs):
            try:
                answered.append((slot, ray.get(ref)))
            except ray.exceptions.RayActorError:
                logger.debug("engine %d did not answer %s: its actor is gone", slot.index, method)
        return answered

    def pause_generation(self, mode: str) -> None:
        self._each("pause_generation", mode)

    def continue_generation(self) -> None:
        self._each("continue_generation")

    def wait_idle(self) -> None:
        """Until every live engine holds no request (``engine.idle_timeout_s``; EngineError past it): after
        a pause, before a memory release or a weight update that flushes the cache."""
        self._each("wait_idle", self.cfg.idle_timeout_s)

    def release_memory_occupation(self) -> None:
        self._each("release_memory_occupation", None)

    def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """``tags``: what comes back (None: everything); the colocated schedule brings the weights back
        first, the KV cache and CUDA graphs once the trainer has given its memory back."""
        self._each("resume_memory_occupation", list(tags) if tags is not None else None)

    def set_weight_format(self, weight_format: str) -> int:
        """Every CPU engine's decode weights from now on, replacements included (SGLang has none); returns
        how many engines changed."""
        if not engine_backend(self.cfg.backend).switch_weight_format:
            return 0
        self.cfg = replace(self.cfg, weight_format=weight_format)
        return sum(changed for _, changed in self._each("set_weight_format", weight_format))

    def weight_versions(self) -> dict[int, str]:
        return {slot.index: version for slot, version in self._each("weight_version")}

    def work_stats(self) -> dict[str, dict[str, float]]:
        """Cumulative counters per live engine, keyed ``"<index>:<incarnation>"``: a replaced engine's
        counters start again at 0 under a new key."""
        return {f"{slot.index}:{slot.info.get('incarnation', '')}": stats
                for slot, stats in self._each("work_stats")}

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the servers of the engines that are up, then kill every actor. An engine that is starting
        or waiting for its bundle (its node may be gone for good) is killed without waiting."""
        try:
            self.refresh()  # engines that died since the last poll are not asked
        except EngineStartError:  # a replacement that never started: killed below like the others
            pass
        for slot in self.slots:
            for ref in slot.placed or []:
                ray.cancel(ref)
            slot.placed = None
        up = [s.actor for s in self.slots if s.state in ("live", "joining")]
        try:
            ray.get([a.shutdown.remote() for a in up], timeout=timeout_s)
        except Exception as err:  # an engine that already died cannot be stopped politely
            logger.warning("engine shutdown incomplete: %s", str(err).strip().splitlines()[0])
        for actor in [s.actor for s in self.slots if s.actor is not None]:
            try:
                ray.kill(actor)
            except Exception:
                pass
