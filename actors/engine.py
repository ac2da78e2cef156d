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

    def __init__(self, engine_cfg: EngineConfig, model_path: str, log_dir: str) -> None:
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
            for env, devices in zip(env_per_engine, _gpu_slices(engine_cfg.num_engines, engine_cfg.tp_size)):
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

    def urls(self) -> list[str]:
        return [p.url for p in self.processes]

    def pids(self) -> list[Optional[int]]:
        return [p.pid for p in self.processes]

    async def health(self) -> list[bool]:
        return list(await asyncio.gather(*(c.health() for c in self.clients)))

    async def _all(self, name: str, *args: Any) -> list[Any]:
        """Call ``EngineClient.<name>`` on every engine concurrently; raise if any failed."""
        results = await asyncio.gather(
            *(getattr(c, name)(*args) for c in self.clients), return_exceptions=True
        )
        failed = [(c.base_url, r) for c, r in zip(self.clients, results) if isinstance(r, BaseException)]
        if failed:
            raise RuntimeError(
                f"{name} failed on {len(failed)} engine(s): " + "; ".join(f"{u}: {e}" for u, e in failed)
            )
        for c, r in zip(self.clients, results):
            if isinstance(r, dict) and r.get("success") is False:
                raise EngineError(400, str(r.get("message")), c.base_url)
        return list(results)

    async def update_weights_from_disk(self, path: str, version: str) -> list[dict[str, Any]]:
        return await self._all("update_weights_from_disk", path, version)

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._all("pause_generation", mode)

    async def continue_generation(self) -> None:
        await self._all("continue_generation")

    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        await self._all("release_memory_occupation", tags)

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        await self._all("resume_memory_occupation", tags)

    async def restart_dead(self) -> list[str]:
        """Restart engines whose process died or stopped answering /health; returns their URLs."""
        restarted = []
        for process, client in zip(self.processes, self.clients):
            if process.alive() and await client.health():
                continue
            logger.warning("engine %s is down; restarting (log: %s)", process.url, process.log_path)
            await client.close()
            await asyncio.get_running_loop().run_in_executor(None, process.restart)
            restarted.append(process.url)
        return restarted

    async def shutdown(self) -> None:
        for client in self.clients:
            await client.close()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, p.stop) for p in self.processes))
