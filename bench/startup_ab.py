"""A warm start, this checkout against another commit, in alternation: did a change to the start help?

    python bench/startup_ab.py --against REF [--rounds 4]

bench/startup.py's runs cannot alternate (a first run, a second, a resume: each needs the one before), and
the load of a shared machine moves more between two bench runs than a change to the start does. Here each
round runs ``python driver.py trainer.steps=0`` (every part started and wired, no step: the start alone)
once in this checkout and once in a git worktree of ``REF``, the order rotating (bench/measure.py), with
the user's warm caches (``RAYRL_CACHE``, as a second run has them) and ``PYTHONPATH`` set to each side's
checkout, so the driver, Ray's workers and the engine's process all import that side's code. The figures
are each run's own (``startup.json``): Ray up, all actors ready, and the span between.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import ROOT, Record, add_common_args, alternate, paired_ratio
from startup import run_driver


def side(tree: Path, scratch: Path, name: str, timeout_s: float):
    runs = iter(range(10**6))

    def run() -> dict[str, float]:
        i = next(runs)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        env.pop("RAY_ADDRESS", None)
        start = run_driver(["trainer.steps=0", f"logging.output_dir={scratch / f'{name}-{i}'}"], env,
                           scratch / f"{name}-{i}.log", timeout_s, cwd=tree)
        phases = start["phases"]
        return {"ray_up->all_actors_ready": phases["all_actors_ready"] - phases["ray_up"],
                "ray_up": phases["ray_up"], "all_actors_ready": phases["all_actors_ready"]}

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="the commit (or branch) to compare this checkout with")
    ap.add_argument("--rounds", type=int, default=3, help="rounds after one warm-up round (its figures dropped)")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    add_common_args(ap)
    args = ap.parse_args()
    ref = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    record = Record("startup_ab", f"A warm start: this checkout against {ref}, alternating", quick=args.quick,
                    record_dir=args.record_dir)
    scratch = Path(tempfile.mkdtemp(prefix="rayrl-startup-ab-"))
    other = scratch / "other"
    subprocess.run(["git", "worktree", "add", "--detach", str(other), ref], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        rounds = 2 if args.quick else args.rounds
        result = alternate({ref: side(other, scratch, "ref", args.timeout_s),
                            "this checkout": side(ROOT, scratch, "this", args.timeout_s)},
                           min_rounds=rounds, max_rounds=rounds, warmup=1, label="startup")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    record.figure("result", result)
    key = "ray_up->all_actors_ready"
    ratio = paired_ratio(result["this checkout"][key], result[ref][key])
    record.table("python driver.py trainer.steps=0, warm caches; seconds from the driver process's start "
                 "(startup.json), median [IQR] (min-max, n); ratio: per-round this / ref",
                 ["side", "Ray up", "all actors ready", "Ray up -> all actors ready"],
                 [[name, figs["ray_up"].fmt(1), figs["all_actors_ready"].fmt(1), figs[key].fmt(1)]
                  for name, figs in result.items()] + [["ratio", "", "", ratio.fmt(2)]])
    record.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
