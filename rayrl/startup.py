"""The run's startup record: when each part of a start was ready, in seconds from the driver process's start.

Why: the time from the command to the first trained step is what a user waits through every time a run
starts or resumes, and the parts of it (Ray, engines, trainer, gateway, sandboxes, the first rollout, the
first step) are only worth cutting once each is known. The driver marks each phase as it happens; the
record is rewritten at every mark to ``RUN_DIR/startup.json``, so a start that dies midway still says
how far it got, and bench/startup.py reads the same figures the run logged (one source of truth).

``startup.json`` holds every start of the run directory, in order (``{"starts": [...]}``): a ``--resume``
adds one. Each start has ``origin`` (what its offsets count from: ``process`` = the driver process's start,
read from the kernel, so Python's own imports count; ``clock`` = when the clock was made, in a notebook),
``started_at`` (Unix time of that origin), ``resume``, and ``phases``: ``{name: seconds}`` in the order
reached, plus ``details``, what a phase reported (a cache hit or a build, the seconds inside a part).

Phases the driver and the pipeline mark (absent when a start never reached them):

- ``imports_done``: the interpreter started and the driver's first imports done (what it needs to load and
  check a config; nothing heavy: tests/test_driver_imports.py);
- ``config_loaded``: the config parsed and checked (the run directory printed);
- ``model_ready``: the model found on disk (the first run converts the built-in model);
- ``ray_up``: Ray started or joined (its details: ``init_s``, the seconds in ``ray.init``; the rest since
  ``model_ready`` is the driver importing the pipeline's modules);
- ``engines_ready``, ``trainer_ready``, ``gateway_ready``, ``sandboxes_warm``, ``workers_ready``: each part
  (they start together, so each is its own finish time, not a share of a sum);
- ``all_actors_ready``: every part up and wired (the engines' addresses given to the gateway, the weight
  plan connected);
- ``checkpoint_loaded``: with ``--resume``, the checkpoint in the trainer and its weights in the engines (its
  details: ``trainer_load_s`` and ``weight_push_s``, the waits after all actors were ready, and ``preload_s``
  when the trainer loaded the checkpoint as it started, overlapped with the other parts: ``trainer_ready``
  then includes it);
- ``first_rollout_done``: the first step's groups collected; ``first_step_trained``: its line printed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

FILE = "startup.json"
PARTS = ("engines", "trainer", "gateway", "sandboxes", "workers")  # what starts together
READY = {"engines": "engines_ready", "trainer": "trainer_ready", "gateway": "gateway_ready",
         "sandboxes": "sandboxes_warm", "workers": "workers_ready", "teacher": "teacher_ready",
         "judge": "judge_ready"}


def process_start_time(pid: Optional[int] = None) -> Optional[float]:
    """Unix time at which process ``pid`` (default: this one) started, from /proc (Linux; to 10 ms); None
    elsewhere. Its age is the system's uptime less its start in clock ticks after boot (the boot time in
    /proc/stat is whole seconds, too coarse here)."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        return now - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Marks the phases of one start, as seconds after its origin, and keeps the run's record of them."""

    def __init__(self, *, from_process: bool = True, resume: bool = False) -> None:
        """``from_process``: count from this process's start (the driver); otherwise from now (a notebook,
        where the process started long before the run)."""
        origin = process_start_time() if from_process else None
        self.origin = "process" if origin is not None else "clock"
        # time.time() for the origin (the kernel's), monotonic offsets after it: a clock step cannot move them
        now_wall, now_mono = time.time(), time.monotonic()
        self.started_at = origin if origin is not None else now_wall
        self._mono0 = now_mono - (now_wall - self.started_at)
        self.resume = resume
        self.phases: dict[str, float] = {}
        self.details: dict[str, Any] = {}
        self.run_dir: Optional[Path] = None
        self._index: Optional[int] = None  # this start's place in the run's record
        self._lock = threading.Lock()  # parts starting together mark from their own threads

    def now(self) -> float:
        """Seconds since the origin."""
        return time.monotonic() - self._mono0

    def mark(self, phase: str, **details: Any) -> float:
        """Record ``phase`` now (only its first time: a phase is when it was first reached); returns its
        offset. ``details`` are kept under the phase's name."""
        with self._lock:
            if phase not in self.phases:
                self.phases[phase] = round(self.now(), 3)
                if details:
                    self.details[phase] = details
                self._write()
            return self.phases[phase]

    def seen(self, phase: str) -> bool:
        return phase in self.phases

    def attach(self, run_dir: Path) -> None:
        """Keep the record in ``run_dir`` from now on (the phases so far are written at once)."""
        with self._lock:
            self.run_dir = Path(run_dir)
            self._write()

    def as_dict(self) -> dict[str, Any]:
        return {"origin": self.origin, "started_at": round(self.started_at, 3), "pid": os.getpid(),
                "resume": self.resume, "phases": dict(self.phases), "details": dict(self.details)}

    def summary(self, upto: str) -> str:
        """One line: the parts' ready times and ``upto``, e.g. for the log when every actor is up."""
        parts = ", ".join(f"{name} {self.phases[READY[name]]:.1f} s" for name in READY if READY[name] in self.phases)
        ray_up = self.phases.get("ray_up")
        since_ray = f", {self.phases[upto] - ray_up:.1f} s after Ray was up" if ray_up is not None else ""
        origin = "the process's start" if self.origin == "process" else "the pipeline's start"
        return f"{upto.replace('_', ' ')} {self.phases[upto]:.1f} s after {origin}{since_ray}" + (
            f" ({parts})" if parts else "")

    def _write(self) -> None:
        if self.run_dir is None:
            return
        path = self.run_dir / FILE
        try:
            starts = read_starts(self.run_dir)
            if self._index is None or self._index >= len(starts):
                self._index = len(starts)
                starts.append({})
            starts[self._index] = self.as_dict()
            tmp = path.with_name(f".{FILE}.{os.getpid()}")
            tmp.write_text(json.dumps({"starts": starts}, indent=1))
            os.replace(tmp, path)
        except OSError as err:  # the record is for reading later; a run is never stopped for it
            logger.warning("could not write %s: %s", path, err)


def read_starts(run_dir: Path) -> list[dict[str, Any]]:
    """Every start recorded in ``run_dir`` (oldest first); [] when there is no record or it is unreadable."""
    try:
        data = json.loads((Path(run_dir) / FILE).read_text())
        return list(data.get("starts", []))
    except (OSError, ValueError, AttributeError):
        return []
