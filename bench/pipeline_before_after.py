"""``make run``'s wall time and the files task's step time: this checkout against another one (the code
before a change), the two alternating round by round (bench/measure.py), on the same machine the same day.

Each side runs ``python driver.py`` from its own checkout, with ``PYTHONPATH`` at that checkout (Ray workers
inherit it, so every actor runs that side's code) and its own output directory:

- make run: the embedded default (examples/calculator, 10 steps), as ``make run`` starts it; figure: the
  process's wall time, Ray's start and shutdown included;
- the files task: examples/files/config.yaml for ``--files-steps`` steps without evaluation; figure: the
  median of its steps' ``time/step_s`` (metrics.jsonl), and its wall time.

Not part of a plain ``make bench`` (it needs a second checkout): ``make bench BASE=/path/to/old/checkout``
runs it, e.g. after ``git worktree add /tmp/base <old commit>``.

    python bench/pipeline_before_after.py --base /tmp/base [--files-steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import ROOT, Record, add_common_args, alternate, paired_ratio


def git_commit(checkout: Path) -> str:
    out = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h %s"], capture_output=True,
                         text=True, check=False)
    return out.stdout.strip()[:90] or "?"


def run_driver(checkout: Path, out_dir: Path, args: list[str], timeout_s: float) -> dict[str, float]:
    """``python driver.py ARGS`` in ``checkout``; its wall time and its steps' ``time/step_s``."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "driver.py", *args, f"logging.output_dir={out_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} in {checkout} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
    steps = []
    for path in out_dir.glob("*/metrics.jsonl"):
        steps += [row["time/step_s"] for row in map(json.loads, path.read_text().splitlines()) if "time/step_s" in row]
    if not steps:
        raise RuntimeError(f"no step metrics under {out_dir}")
    return {"wall_s": wall, "step_s": statistics.median(steps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (the code before)")
    ap.add_argument("--files-steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per figure")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="longest one run may take")
    ap.add_argument("--only", choices=("make run", "files task"), default=None,
                    help="measure one of the two (each round of make run takes ~7 min a side on 2 cores)")
    add_common_args(ap)
    args = ap.parse_args()
    sides = {"before": args.base.resolve(), "after": ROOT}
    for name, path in sides.items():
        if not (path / "driver.py").exists():
            ap.error(f"{name}: no driver.py in {path}")
    record = Record("pipeline_before_after", "make run and the files task, before and after (two checkouts)",
                    quick=args.quick, record_dir=args.record_dir)
    scratch = Path(tempfile.mkdtemp(prefix="rayrl-before-after-"))
    runs = {"make run": ([] if not args.quick else ["trainer.steps=2"]),
            "files task": ["--config", "examples/files/config.yaml",
                           f"trainer.steps={2 if args.quick else args.files_steps}", "pipeline.eval_interval=0"]}
    if args.only:
        runs = {args.only: runs[args.only]}
    results = {}
    for name, driver_args in runs.items():
        count = {side: 0 for side in sides}

        def side(which: str, driver_args: list[str] = driver_args, name: str = name, count: dict = count):
            def go() -> dict[str, float]:
                count[which] += 1
                out = scratch / f"{name.replace(' ', '-')}-{which}-{count[which]}"
                return run_driver(sides[which], out, [*driver_args, f"exp_id={which}{count[which]}"], args.timeout_s)
            return go

        results[name] = alternate({s: side(s) for s in sides}, min_rounds=args.rounds, max_rounds=args.rounds,
                                  warmup=0, label=name)
    rows = []
    for name, figure, unit in (("make run", "wall_s", "s, whole run"), ("files task", "step_s", "s per step"),
                               ("files task", "wall_s", "s, whole run")):
        if name not in results:
            continue
        before, after = results[name]["before"][figure], results[name]["after"][figure]
        rows.append([f"{name}: {unit}", before.fmt(1), after.fmt(1), paired_ratio(before, after).fmt(2, "x")])
        record.figure(f"{name} {figure}", {"before": before, "after": after})
    record.table("median [IQR] (min-max, n) over alternating rounds; before/after is the median of per-round "
                 "ratios (above 1: faster after)", ["measurement", "before", "after", "speed-up"], rows)
    record.note(f"before: {git_commit(sides['before'])} ({sides['before']}); after: {git_commit(ROOT)}. "
                "make run = python driver.py (examples/calculator, 10 steps); files task = examples/files/config.yaml, "
                f"trainer.steps={2 if args.quick else args.files_steps}, no evaluation. "
                "Each run starts its own local Ray."
                + (f" Only {args.only} measured in this run (--only)." if args.only else ""))
    record.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
