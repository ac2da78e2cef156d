"""Side-by-side measurement for every benchmark in bench/: how a bench compares, reports and records.

Contract:

- :func:`alternate` runs each side once per round, rotating the order from round to round (A B, B A,
  A B, ...). A burst of load elsewhere on the machine, or a cache warmed by the side before, then falls
  on every side alike. It repeats until the spread is known: at least ``min_rounds`` rounds, then
  until every figure's interquartile range is within ``rel_iqr`` of its median, or ``max_rounds``
  rounds, or ``budget_s`` seconds. A side's callable returns one number or a dict of named numbers
  (one run may give several figures, e.g. total and decode-only seconds). Every figure is kept per
  round, so two sides' figures pair up round by round (:func:`paired_ratio`).
- :class:`Spread` holds one figure's samples. ``fmt()`` is how every bench prints it:
  ``median [q1-q3] (min-max, n)``.
- :class:`Record` is what a bench found, with what a skeptical reader needs to judge it: the command,
  the date, the machine (CPU model, cores), the load average at start and end, whether ``--quick``
  cut the repeats, its tables and notes. ``save()`` writes ``runs/bench/<name>.json``;
  bench/report.py renders every such file into docs/benchmarks.md.
- ``--quick`` (or ``BENCH_QUICK=1``) is every bench's smoke mode: few repeats and small sizes. A quick
  record says so, and the report marks it as not a result.

Why: a ratio of best-of-N runs taken one side after the other moves with whatever else the machine
does. Issue 21 measured 2.80x on a loaded machine and 1.24x on a quiet one for the same code. Medians
measured in alternation, printed with their spread and the load beside them, show how far to trust
each figure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

ROOT = Path(__file__).resolve().parents[1]
RECORD_DIR = ROOT / "runs" / "bench"

BUSY_WARNING = ("the machine is busy (1-minute load average above half the cores): alternation spreads load over "
                "both sides, but contention does not hit every side alike (spinning threads wait far longer on a "
                "shared core), so these figures are not results")

# longest wait for the load average to settle before a bench starts (BENCH_QUIET_WAIT_S=0: start at once, on a
# machine other work keeps busy anyway; the record says the load either way)
QUIET_WAIT_S = float(os.environ.get("BENCH_QUIET_WAIT_S", "150"))

Figures = Union[float, Mapping[str, float]]
VALUE = "value"  # the figure name of a side that returns a single number


@dataclass(frozen=True)
class Spread:
    """One figure's samples, in the order they were taken (one per round)."""

    samples: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        if self.n < 2:
            return self.samples[0], self.samples[0]
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q1, q3

    @property
    def rel_iqr(self) -> float:
        """Interquartile range over |median| (0 when every sample is equal, inf around a zero median)."""
        q1, q3 = self.quartiles
        if q3 == q1:
            return 0.0
        return (q3 - q1) / abs(self.median) if self.median else float("inf")

    def scaled(self, fn: Callable[[float], float]) -> "Spread":
        """The same samples mapped through ``fn`` (seconds to tokens/s, to milliseconds, ...)."""
        return Spread(tuple(fn(x) for x in self.samples))

    def fmt(self, digits: int = 2, unit: str = "") -> str:
        """``median [q1-q3] (min-max, n)``; the range in parentheses is left out for one sample."""
        q1, q3 = self.quartiles
        f = f"{{:.{digits}f}}"
        text = f"{f.format(self.median)}{unit}"
        if self.n > 1:
            text += (f" [{f.format(q1)}-{f.format(q3)}] ({f.format(min(self.samples))}-"
                     f"{f.format(max(self.samples))}, n={self.n})")
        return text

    def as_dict(self) -> dict[str, Any]:
        q1, q3 = self.quartiles
        return {"median": self.median, "q1": q1, "q3": q3, "min": min(self.samples),
                "max": max(self.samples), "n": self.n, "samples": list(self.samples)}


def paired_ratio(a: Spread, b: Spread) -> Spread:
    """Per-round ratios a_i / b_i of two figures taken in the same rounds (load hits both alike)."""
    if a.n != b.n:
        raise ValueError(f"paired_ratio needs as many samples on both sides ({a.n} != {b.n})")
    return Spread(tuple(x / y for x, y in zip(a.samples, b.samples)))


def alternate(
    sides: Mapping[str, Callable[[], Figures]],
    *,
    min_rounds: int = 5,
    max_rounds: int = 15,
    rel_iqr: float = 0.10,
    warmup: int = 1,
    budget_s: float | None = None,
    label: str = "",
) -> dict[str, dict[str, Spread]]:
    """Run the sides in alternation until the spread is known; {side: {figure: Spread}}.

    ``warmup`` rounds run first and are discarded. A side that raises stops the comparison (a
    benchmark of a broken side measures nothing)."""
    names = list(sides)
    if not names:
        raise ValueError("alternate needs at least one side")
    for _ in range(warmup):
        for name in names:
            sides[name]()
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    start = time.monotonic()
    rounds = 0
    while rounds < max_rounds:
        shift = rounds % len(names)
        for name in names[shift:] + names[:shift]:
            out = sides[name]()
            figures = {VALUE: float(out)} if isinstance(out, (int, float)) else dict(out)
            for key, value in figures.items():
                samples[name].setdefault(key, []).append(float(value))
        rounds += 1
        spent = time.monotonic() - start
        result = {n: {k: Spread(tuple(v)) for k, v in figs.items()} for n, figs in samples.items()}
        if label:
            print(f"  [{label}] round {rounds}: " + "; ".join(
                f"{n} {figs[k].median:.4g}" for n, figs in result.items() for k in list(figs)[:1]),
                flush=True)
        if rounds < min_rounds:
            continue
        settled = all(s.rel_iqr <= rel_iqr for figs in result.values() for s in figs.values())
        if settled or (budget_s is not None and spent >= budget_s):
            break
    return result


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--quick`` (smoke run; also ``BENCH_QUICK=1``) and ``--record-dir`` for every bench."""
    parser.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK", "") not in ("", "0"),
                        help="smoke run: few repeats, small sizes (figures are not results)")
    parser.add_argument("--record-dir", type=Path, default=RECORD_DIR,
                        help="where the JSON record goes (bench/report.py reads it)")


def machine() -> dict[str, Any]:
    """The CPU model (lscpu), core count, SIMD level and memory of this machine."""
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                      if line.startswith("Model name:")), "")
    except (OSError, subprocess.SubprocessError):
        pass
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        pass
    simd = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"),
                                    ("amx_bf16", "AMX")) if flag in flags]
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": model or platform.processor() or "unknown", "cores": os.cpu_count(), "simd": simd,
            "memory_gib": round(mem_gb, 1), "python": platform.python_version()}


def source_commit() -> str:
    """The checkout's commit (short), with ``+changes`` when tracked files differ from it: what was measured."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+changes" if head and dirty else "")


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns aligned for a terminal (the report renders the same cells as markdown)."""
    cells = [[str(c) for c in columns]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Record:
    """One bench run's findings, printed as they come and saved as JSON for docs/benchmarks.md."""

    def __init__(self, name: str, title: str, *, quick: bool, record_dir: Path = RECORD_DIR) -> None:
        self.name, self.title, self.quick = name, title, quick
        self.record_dir = Path(record_dir)
        self.command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)]
                                            + sys.argv[1:])
        self.machine = machine()
        self.commit = source_commit()
        self.waited_s = 0.0 if quick else self.wait_for_quiet()
        self.started = dt.datetime.now().astimezone()
        self.load_start = os.getloadavg()
        self.tables: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.figures: dict[str, Any] = {}
        print(f"== {title}\n{self.command}\n{self.machine['cpu']}, {self.machine['cores']} cores; "
              f"load average at start {_load(self.load_start)}" + ("; QUICK (smoke run)" if quick else ""),
              flush=True)
        if self.waited_s >= 1:
            print(f"waited {self.waited_s:.0f} s for the load average to settle", flush=True)
        if self.busy(self.load_start):
            print(BUSY_WARNING, flush=True)

    def busy(self, load: Sequence[float]) -> bool:
        """Whether other work held more than half the cores (1-minute load average)."""
        return load[0] > 0.5 * (self.machine["cores"] or 1)

    def wait_for_quiet(self, limit_s: float = QUIET_WAIT_S) -> float:
        """Wait (at most ``limit_s``) until the 1-minute load average is below half the cores; returns the
        seconds waited. The previous bench's own threads stay in that average for about a minute after it
        ends, so a run of benches (``make bench``) would otherwise flag every bench after the first."""
        t0 = time.monotonic()
        while self.busy(os.getloadavg()) and time.monotonic() - t0 < limit_s:
            time.sleep(5)
        return time.monotonic() - t0

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.tables.append({"title": title, "columns": list(columns), "rows": [[str(c) for c in r] for r in rows]})
        print(f"\n{title}\n{format_table(columns, rows)}", flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(text, flush=True)

    def figure(self, key: str, value: Any) -> None:
        """A raw figure kept in the JSON (a Spread, also inside a dict, is stored with all its samples)."""
        self.figures[key] = _plain(value)

    def save(self) -> Path:
        load_end = os.getloadavg()
        finished = dt.datetime.now().astimezone()
        data = {
            "name": self.name, "title": self.title, "command": self.command, "quick": self.quick,
            "started": self.started.isoformat(timespec="seconds"),
            "finished": finished.isoformat(timespec="seconds"),
            "duration_s": round((finished - self.started).total_seconds(), 1),
            "machine": self.machine, "commit": self.commit,
            "load_start": list(self.load_start), "load_end": list(load_end),
            # busy: judged at the start only; the load at the end includes this bench's own threads
            "busy": self.busy(self.load_start), "waited_s": round(self.waited_s, 1),
            "tables": self.tables, "notes": self.notes, "figures": self.figures,
        }
        self.record_dir.mkdir(parents=True, exist_ok=True)
        path = self.record_dir / f"{self.name}.json"
        path.write_text(json.dumps(data, indent=1))
        print(f"\nload average at end {_load(load_end)}; {data['duration_s']:.0f} s; record: {path}", flush=True)
        return path


def _plain(value: Any) -> Any:
    if isinstance(value, Spread):
        return value.as_dict()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _load(avg: Sequence[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in avg) + " (1/5/15 min)"
