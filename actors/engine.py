"""EngineActor: one inference engine (SGLang on GPU, the CPU engine elsewhere) as its own Ray actor.

Each engine runs where its placement bundle is, on any node: the actor asks Ray for its share of the
bundle's GPU, and for each further GPU of a tensor-parallel engine a :class:`GpuSeat` actor holds that
bundle's GPU, so Ray accounts for every GPU an engine uses. The actor starts the server process
(rayrl.engines.launcher.EngineProcess) with exactly those GPUs visible, from one long-lived thread with
``die_with_parent``: when the actor dies (killed, its node lost), its server dies with it instead of
holding the port and the device.

A thin shell: callers route ``/generate`` themselves (rayrl.engines.router) and weights arrive straight
from the trainer over HTTP (rayrl/weights/); this actor reports where it serves and fans control calls
(pause, memory) to its server. ``watch()`` returns when the server exits, so the driver learns of a dead
engine from one pending call (actors/engine_fleet.py), without polling.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayrl.config import EngineConfig
from rayrl.engines.client import EngineClient, EngineError
from rayrl.engines.launcher import EngineProcess
from rayrl.weights.owners import sweep_quietly

logger = logging.getLogger(__name__)

BIND_ALL = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class EngineSeat:
    """Where one engine sits in the shared placement group: its bundles (the actor runs on the first)
    and the share of each bundle's GPU it claims (the rest belongs to a colocated trainer rank)."""

    group: Any  # ray.util.placement_group.PlacementGroup
    bundles: tuple[int, ...]
    gpu_fraction: float

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=bundle)

    def actor_options(self) -> dict[str, Any]:
        return {"num_gpus": self.gpu_fraction, "num_cpus": 0, "scheduling_strategy": self.strategy(self.bundles[0])}


@ray.remote(num_cpus=0)
def bundle_probe() -> str:
    """Runs on a placement bundle and returns its node: the bundle is placed on a live node."""
    return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0)
class GpuSeat:
    """Holds one further GPU of a tensor-parallel engine for Ray's accounting; reports its id."""

    def gpu(self) -> tuple[str, list[str]]:
        return ray.get_runtime_context().get_node_id(), [str(int(g)) for g in ray.get_gpu_ids()]


@ray.remote(num_cpus=0)
class EngineActor:
    """One engine server process, started when the actor is created."""

    def __init__(
        self,
        cfg: EngineConfig,
        model_path: str,
        log_dir: str,
        index: int,
        seat: Optional[EngineSeat] = None,
    ) -> None:
        sweep_quietly()  # weight buffers of killed processes on this node (rayrl/weights/shm.py)
        self.index = index
        self.cfg = cfg
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.bundles: tuple[int, ...] = seat.bundles if seat is not None else ()
        self.incarnation = uuid.uuid4().hex[:12]
        self.seats, seat_gpus = self._hold_other_gpus(seat)
        self.gpu_ids = [str(int(g)) for g in ray.get_gpu_ids()] + seat_gpus
        # SGLang's TP rank r uses the r-th visible GPU; the CPU engine reads the same list to check that each
        # rank's weight payload was made on that rank's (logical) GPU (rayrl/weights/tp_payloads.py)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(self.gpu_ids)} if self.gpu_ids else {}
        advertise = self.node_ip if cfg.host in BIND_ALL else cfg.host
        self.process = EngineProcess(cfg, model_path, Path(log_dir) / f"engine-{index}.log", backend=cfg.backend,
                                     env=env, advertise_host=advertise, die_with_parent=True)
        # every Popen from this one thread, which lives as long as the actor (die_with_parent's contract)
        self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{index}-launcher")
        self._launcher.submit(self.process.start).result()
        self.client = EngineClient(self.process.url, timeout_s=cfg.request_timeout_s)
        self.started_at = time.time()
        logger.debug("engine %d serving at %s on node %s (GPUs %s)", index, self.process.url, self.node_id[:12],
                     ",".join(self.gpu_ids) or "none")

    def _hold_other_gpus(self, seat: Optional[EngineSeat]) -> tuple[list[Any], list[str]]:
        """A GpuSeat on each bundle after the first, and their GPU ids; each must be on this node (one
        server spans them)."""
        if seat is None or len(seat.bundles) < 2:
            return [], []
        seats = [GpuSeat.options(num_gpus=seat.gpu_fraction, scheduling_strategy=seat.strategy(b)).remote()
                 for b in seat.bundles[1:]]
        found = ray.get([s.gpu.remote() for s in seats])
        elsewhere = [b for b, (node, _) in zip(seat.bundles[1:], found) if node != self.node_id]
        if elsewhere:
            raise RuntimeError(f"engine {self.index}: bundles {elsewhere} are on another node than bundle "
                               f"{seat.bundles[0]}; a tensor-parallel engine needs its GPUs on one node")
        return seats, [g for _, gpus in found for g in gpus]

    # -- where and what ----------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Where this engine serves: index, url, node, bundles, GPUs, server pid, incarnation, server log."""
        return {"index": self.index, "url": self.process.url, "node_id": self.node_id, "node_ip": self.node_ip,
                "bundles": list(self.bundles), "gpu_ids": list(self.gpu_ids), "pid": self.process.pid,
                "incarnation": self.incarnation, "tp_size": self.cfg.tp_size, "started_at": self.started_at,
                "log_path": str(self.process.log_path)}

    async def watch(self) -> int:
        """Return the server's exit code once it exits (an error instead, if this actor dies first). It logs
        nothing: the fleet turns the return into the one "down" event that is logged, and after
        :meth:`shutdown` an exit is no failure at all."""
        while self.process.alive():
            await asyncio.sleep(0.5)
        code = self.process.stop()
        return -1 if code is None else int(code)

    async def health(self) -> bool:
        return self.process.alive() and await self.client.health()

    async def weight_version(self) -> str:
        return await self.client.get_weight_version()

    async def work_stats(self) -> dict[str, float]:
        """Cumulative counters of the server (the CPU engine's: prompt tokens, prefix-cache hits, seconds in
        prefill and decode forward passes); 0 for what the server does not report."""
        keys = {"prompt_tokens": "prompt_tokens", "cached_prompt_tokens": "prefix_cache_hit_tokens",
                "prefill_s": "prefill_seconds", "decode_s": "decode_seconds", "requests": "requests_finished",
                "weight_pack_s": "weight_pack_seconds"}
        try:
            info = await self.client.get_server_info()
        except EngineError:
            info = {}
        states = info.get("internal_states") if isinstance(info, dict) else None
        state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
        return {name: float(state.get(key, 0) or 0) for name, key in keys.items()}

    async def control_log(self) -> list[str]:
        """The state-changing calls the server accepted, in order (pause, memory, weights from any sender)."""
        info = await self.client.get_server_info()
        return [str(c) for c in info.get("control_calls", [])] if isinstance(info, dict) else []

    # -- control (the colocated schedule's phases) ---------------------------------------------------

    async def _call(self, name: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        call = getattr(self.client, name)(*args)
        try:
            result = await (asyncio.wait_for(call, timeout_s) if timeout_s else call)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine {self.index} ({self.process.url}): {name}: no answer within "
                               f"{timeout_s:.0f} s") from None
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(400, f"{name}: {result.get('message')}", self.process.url)
        return result

    async def set_weight_format(self, weight_format: str) -> bool:
        """The CPU engine's decode weights (the pipeline's float32 fallback, rayrl/rl/logprob_gap.py); True
        when they changed."""
        reply = await self._call("set_weight_format", weight_format)
        return reply.get("previous_weight_format") != weight_format

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._call("pause_generation", mode)

    async def continue_generation(self) -> None:
        await self._call("continue_generation")

    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        await self._call("release_memory_occupation", tags)

    async def wait_idle(self, timeout_s: float) -> float:
        """Until no request is running on the server (after a pause, before a release or an update)."""
        return await self.client.wait_idle(timeout_s)

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        await self._call("resume_memory_occupation", tags)

    async def shutdown(self) -> None:
        """Stop the server; the actor can then be killed."""
        await self.client.close()
        await asyncio.get_running_loop().run_in_executor(self._launcher, self.process.stop)
