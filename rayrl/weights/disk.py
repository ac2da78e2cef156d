"""The disk transport: a versioned safetensors directory in shared memory, loaded by ``/update_weights_from_disk``.

The default on CPU for engines on the sending rank's node: /dev/shm is memory, so this is a copy in RAM
either way, with nothing to keep open between updates (about 0.3 s for 135M parameters on this machine's
kind). Each sending rank writes under its own directory (``root/rank<r>-<pid>-<start>/v<version>``:
several nodes of a one-machine test cluster share /dev/shm, and a sweep removes the directory of a rank
that was killed, rayrl/weights/shm.py), and only the newest version is kept. The path means nothing on
another machine, so rayrl/weights/plan.py only gives this transport engines on the sender's node.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Optional, Sequence

from rayrl.weights.files import write_weights
from rayrl.weights.transfer import (
    EngineTarget,
    NamedTensors,
    TransferStats,
    check_results,
    close_clients,
    verify_version,
)

logger = logging.getLogger(__name__)


class DiskSender:
    """Write the weights once, then have every engine load them (concurrently)."""

    def __init__(self, engines: Sequence[EngineTarget], root: str | Path, *, timeout_s: float = 300.0) -> None:
        if not engines:
            raise ValueError("no engines to send weights to")
        self.engines = list(engines)
        self.root = Path(root)
        self.timeout_s = timeout_s
        self.last_path: Optional[Path] = None

    async def connect(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    async def send(self, named_tensors: NamedTensors, version: str | int) -> TransferStats:
        version = str(version)
        stats = TransferStats(version)
        started = time.perf_counter()
        state = {name: t.detach().to("cpu", copy=False).contiguous() for name, t in named_tensors}
        path = await asyncio.get_running_loop().run_in_executor(
            None, write_weights, state, self.root, int(version)
        )
        stats.add_bucket(list(state.values()))
        results = await asyncio.gather(
            *(
                asyncio.wait_for(e.client.update_weights_from_disk(str(path), version), self.timeout_s)
                for e in self.engines
            ),
            return_exceptions=True,
        )
        check_results(
            [TimeoutError(f"no answer within {self.timeout_s:.0f} s") if isinstance(r, asyncio.TimeoutError) else r
             for r in results],
            self.engines,
            "update_weights_from_disk",
        )
        self.last_path = path
        stats.seconds = time.perf_counter() - started
        await verify_version(self.engines, version)
        logger.info("weights v%s loaded from %s by %d engine(s): %.1f MB, %.2f GB/s",
                    version, path, len(self.engines), stats.bytes / 1e6, stats.gb_per_s)
        return stats

    async def close(self) -> None:
        """Remove the files: each engine holds its own copy once it has loaded them."""
        await close_clients(self.engines)
        shutil.rmtree(self.root, ignore_errors=True)

