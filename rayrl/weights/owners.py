"""Weight buffers' names and owners: which process made a buffer, whether it still runs, and the sweep that
removes the buffers (and disk-transport directories) of owners that are gone.

Apart from rayrl/weights/shm.py (the buffers themselves, torch tensors over shared memory) so that what runs
at every actor's start, :func:`sweep_quietly`, imports no torch: an engine actor only sweeps and starts its
server process, and importing torch for the sweep alone held the server's start back by the seconds that
import takes on a loaded machine (the engine is the last part a run waits for).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

PREFIX = "rayrl-wbuf-"
WEIGHT_BUFFERS = "rayrl-shm"  # what an engine that opens these says in /get_server_info ``weight_buffers``
NAME = re.compile(r"^rayrl-wbuf-(\d+)-(\d+)-[0-9a-f]{12}$")
OWNED_DIR = re.compile(r"^rank\d+-(\d+)-(\d+)$")  # the disk transport's rank<r>-<pid>-<start> directories


def shared_memory_root() -> Path:
    """/dev/shm where it is writable (memory), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks after boot (None: no such process, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'
    return int(stat[stat.rindex(")") + 2:].split()[19])


def owner_tag(pid: Optional[int] = None) -> str:
    """``<pid>-<start>`` of a process (default: this one), the owner part of a buffer's name."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{_start_time(pid) or 0}"


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process that made a buffer still runs (the same pid *and* start time)."""
    now = _start_time(pid)
    if now is not None:
        return start == 0 or now == start
    if Path("/proc/self/stat").exists():  # /proc works and has no such pid: gone
        return False
    try:  # no /proc (not Linux): the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead_buffers(root: Optional[Path] = None) -> list[str]:
    """Remove the weight buffers (and disk-transport directories) whose owner process is gone; returns
    their names. Run at trainer and engine start: files of a process killed with SIGKILL go here."""
    root = Path(root) if root is not None else shared_memory_root()
    removed: list[str] = []
    freed = 0
    for path in root.glob(f"{PREFIX}*"):
        m = NAME.match(path.name)
        if m and not owner_alive(int(m.group(1)), int(m.group(2))):
            try:
                freed += path.stat().st_size
                path.unlink()
                removed.append(path.name)
            except FileNotFoundError:  # another sweeper got there first
                pass
    for run_dir in root.glob("rayrl-*-weights"):
        for path in run_dir.iterdir() if run_dir.is_dir() else []:
            m = OWNED_DIR.match(path.name)
            if m and not owner_alive(int(m.group(1)), int(m.group(2))):
                freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path, ignore_errors=True)
                removed.append(f"{run_dir.name}/{path.name}")
    if removed:
        shown = ", ".join(removed[:5]) + (" ..." if len(removed) > 5 else "")
        logger.warning("removed %d weight buffer(s) (%.0f MiB) left in %s by processes that are gone: %s",
                       len(removed), freed / 2**20, root, shown)
    return removed


def sweep_quietly() -> list[str]:
    """:func:`sweep_dead_buffers` for actor start-up: a sweep that fails must not stop a start."""
    try:
        return sweep_dead_buffers()
    except OSError as err:
        logger.warning("sweeping dead weight buffers failed: %s", err)
        return []
