"""Weight buffers left in shared memory by a process killed with SIGKILL, for the tests that check that
trainer ranks and engines sweep them when they start (rayrl/weights/shm.py).

The owner is a real process that makes a SharedBuffer and a disk-transport directory, as a trainer rank
does, and is then SIGKILLed, which no cleanup code survives.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rayrl.weights.owners import shared_memory_root

ROOT = Path(__file__).resolve().parents[1]

OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from rayrl.weights.owners import owner_tag
    from rayrl.weights.shm import SharedBuffer

    buffer = SharedBuffer(1 << 20)
    buffer.typed(torch.float32, 4).copy_(torch.arange(4.0))
    weights = Path(sys.argv[1]) / f"rank0-{owner_tag()}" / "v000001"  # the disk transport's layout
    weights.mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(b"x" * 4096)
    print(buffer.name, weights.parent, flush=True)
    if sys.argv[2] == "sleep":
        time.sleep(600)
""")


def start_owner(run_dir: Path, mode: str = "sleep") -> tuple[subprocess.Popen, Path, Path]:
    """An owner process (``mode`` sleep: it stays; exit: it exits without closing): the process, its
    buffer's path and its disk-transport directory."""
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(run_dir), mode], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    name, directory = proc.stdout.readline().split()
    return proc, shared_memory_root() / name, Path(directory)


def sigkill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)


@contextmanager
def run_weights_dir() -> Iterator[Path]:
    """A run's disk-transport root in shared memory (as WeightSync names it), removed afterwards."""
    path = shared_memory_root() / f"rayrl-test{uuid.uuid4().hex[:8]}-weights"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def left_by_a_killed_owner() -> Iterator[tuple[Path, Path]]:
    """The buffer and disk-transport directory of an owner killed with SIGKILL (both still there)."""
    with run_weights_dir() as run_dir:
        owner, buffer, weights = start_owner(run_dir)
        sigkill(owner)
        assert buffer.exists() and weights.exists()  # SIGKILL ran no cleanup: without a sweep they stay
        try:
            yield buffer, weights
        finally:
            buffer.unlink(missing_ok=True)
