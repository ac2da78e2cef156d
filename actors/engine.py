"""EngineGroup: a Ray actor that owns N engine server processes (SGLang on GPU, the CPU engine elsewhere).

A thin shell: processes come from rayrl.engines.launcher, HTTP calls from rayrl.engines.client. Callers
get the URLs and route ``/generate`` themselves (rayrl.engines.router); this actor fans out the
control calls (weights, pause, memory) to every engine concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence

import ray

from rayrl.config import EngineConfig
from rayrl.engines.client import EngineClient, EngineError
from rayrl.engines.launcher import EngineProcess, resolve_backend

logger = logging.getLogger(__name__)


def _gpu_slices(num_engines: int, tp_size: int) -> list[Optional[str]]:
    """CUDA_VISIBLE_DEVICES for each SGLang engine: consecutive tp_size-wide slices of this actor's GPUs."""
    ids = [str(int(i)) for i in ray.get_gpu_ids()]
    if not ids:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else []
    if not ids:
        return [None] * num_engines
    return [",".join(ids[i * tp_size : (i + 1) * tp_size]) or None for i in range(num_engines)]


@ray.remote(num_cpus=0)
class EngineGroup:
    """``engine_cfg.num_engines`` engine servers, launched in parallel, with fan-out control calls."""

    def __init__(
        self,
        engine_cfg: EngineConfig,
        model_path: str,
        log_dir: str,
        engine_devices: Optional[Sequence[str]] = None,
    ) -> None:
        """``engine_devices``: CUDA_VISIBLE_DEVICES per engine from a shared placement group
        (actors.placement.SharedPlacement.all_engine_devices); else slices of this actor's own GPUs."""
        self.cfg = engine_cfg
        self.backend = resolve_backend(engine_cfg)
        if self.backend == "sglang":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError(
                    "engine.backend=sglang needs CUDA; use backend cpu (or auto) on this machine"
                )
        env_per_engine: list[dict[str, str]] = [{} for _ in range(engine_cfg.num_engines)]
        if self.backend == "sglang":
            slices = engine_devices or _gpu_slices(engine_cfg.num_engines, engine_cfg.tp_size)
            for env, devices in zip(env_per_engine, slices):
                if devices is not None:
                    env["CUDA_VISIBLE_DEVICES"] = devices
        self.processes = [
            EngineProcess(
                engine_cfg, model_path, Path(log_dir) / f"engine-{i}.log", backend=self.backend, env=env
            )
            for i, env in enumerate(env_per_engine)
        ]
        with ThreadPoolExecutor(max_workers=len(self.processes)) as pool:
            errors = [f.exception() for f in [pool.submit(p.start) for p in self.processes]]
        if any(errors):
            for p in self.processes:
                p.stop()
            raise RuntimeError(f"engine launch failed: {next(e for e in errors if e)}")
        self.clients = [EngineClient(p.url, timeout_s=engine_cfg.request_timeout_s) for p in self.processes]
        self.calls: list[str] = []  # control calls in order (the colocated schedule's test reads them)
        self.last_weights: Optional[tuple[str, str]] = None  # (path, version) re-applied after a restart

    def urls(self) -> list[str]:
        return [p.url for p in self.processes]

    def pids(self) -> list[Optional[int]]:
        return [p.pid for p in self.processes]

    async def health(self) -> list[bool]:
        return list(await asyncio.gather(*(c.health() for c in self.clients)))

    async def work_stats(self) -> dict[str, float]:
        """Cumulative counters summed over the engines: prompt tokens prefilled, those served from the
        prefix cache, and seconds spent in prefill and decode forward passes (the CPU engine's counters;
        engines that do not report them, or do not answer, count 0)."""
        infos = await asyncio.gather(*(c.get_server_info() for c in self.clients), return_exceptions=True)
        keys = {"prompt_tokens": "prompt_tokens", "cached_prompt_tokens": "prefix_cache_hit_tokens",
                "prefill_s": "prefill_seconds", "decode_s": "decode_seconds"}
        totals = {name: 0.0 for name in keys}
        for info in infos:
            states = info.get("internal_states") if isinstance(info, dict) else None
            state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
            for name, key in keys.items():
                totals[name] += float(state.get(key, 0) or 0)
        return totals

    def control_log(self) -> list[str]:
        return list(self.calls)

    async def _all(self, name: str, *args: Any, timeout_s: Optional[float] = None) -> list[Any]:
        """Call ``EngineClient.<name>`` on every engine concurrently; raise if any failed or, with
        ``timeout_s``, did not answer in time (a hung engine must not hang the run)."""
        self.calls.append(name)

        async def one(client: EngineClient) -> Any:
            call = getattr(client, name)(*args)
            if timeout_s is None:
                return await call
            try:
                return await asyncio.wait_for(call, timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no answer within {timeout_s:.0f} s") from None

        results = await asyncio.gather(*(one(c) for c in self.clients), return_exceptions=True)
        failed = [(c.base_url, r) for c, r in zip(self.clients, results) if isinstance(r, BaseException)]
        if failed:
            raise RuntimeError(
                f"{name} failed on {len(failed)} engine(s): " + "; ".join(f"{u}: {e}" for u, e in failed)
            )
        for c, r in zip(self.clients, results):
            if isinstance(r, dict) and r.get("success") is False:
                raise EngineError(400, str(r.get("message")), c.base_url)
        return list(results)

    async def update_weights_from_disk(
        self, path: str, version: str, timeout_s: Optional[float] = None
    ) -> list[dict[str, Any]]:
        results = await self._all("update_weights_from_disk", path, version, timeout_s=timeout_s)
        self.last_weights = (path, version)
        return results

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._all("pause_generation", mode)

    async def continue_generation(self) -> None:
        await self._all("continue_generation")

    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        await self._all("release_memory_occupation", tags)

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        await self._all("resume_memory_occupation", tags)

    def dead(self) -> list[str]:
        """URLs of engines whose process has exited (cheap: no HTTP)."""
        return [p.url for p in self.processes if not p.alive()]

    async def restart_dead(self, check_health: bool = True) -> list[str]:
        """Restart engines whose process died (or, with ``check_health``, stopped answering /health);
        a restarted engine gets the newest weights again. Returns their URLs (same URL: same port)."""
        restarted = []
        for process, client in zip(self.processes, self.clients):
            if process.alive() and (not check_health or await client.health()):
                continue
            logger.warning("engine %s is down; restarting (log: %s)", process.url, process.log_path)
            await client.close()
            await asyncio.get_running_loop().run_in_executor(None, process.restart)
            if self.last_weights is not None:
                await client.update_weights_from_disk(*self.last_weights)
            restarted.append(process.url)
        return restarted

    async def shutdown(self) -> None:
        for client in self.clients:
            await client.close()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, p.stop) for p in self.processes))
