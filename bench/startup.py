"""Time to the first trained step: ``python driver.py`` on the default config, from the process's start to
Ray up, each part ready, the first rollout and the first step, for a first run (every cache empty), a second
run (every cache warm) and a ``--resume`` from the second run's checkpoint.

Each run is the real thing, a subprocess ``python driver.py`` (examples/calculator, the embedded default,
with ``trainer.steps=1`` so that it ends after the first step, and ``--resume`` with ``trainer.steps=2``),
starting its own local Ray. The figures are the run's own: the driver writes each phase, in seconds from
its process's start, to ``RUN_DIR/startup.json`` (rayrl/startup.py), and this bench reads that file; it
never times from outside what the run recorded.

- first run: ``RAYRL_CACHE`` and ``TORCH_EXTENSIONS_DIR`` at an empty folder, so the built-in model is
  converted and the decode kernels are compiled (what a user's very first run does; Python's bytecode and
  the OS page cache stay warm: they are not rayrl's to empty);
- second run: the same caches, now filled: nothing is converted or built again;
- resume: ``--resume`` from the second run's step-1 checkpoint (the trainer and engines load its weights).

One round is the three runs in that order (each needs the one before: they cannot alternate); rounds
repeat it with a fresh cache folder. The goals (issue 46), warm caches: Ray up to all actors ready
<= 15 s; ``--resume`` to its first rollout <= 20 s (from the command, and from Ray up: both shown).

    python bench/startup.py [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from measure import ROOT, Record, Spread, add_common_args

RUNS = ("first run", "second run", "resume")
# the phases shown, in the order a start reaches them (rayrl/startup.py)
PHASES = ("imports_done", "config_loaded", "model_ready", "ray_up", "sandboxes_warm", "workers_ready", "gateway_ready",
          "trainer_ready", "engines_ready", "all_actors_ready", "checkpoint_loaded", "first_rollout_done",
          "first_step_trained")
GOALS = (  # (run, figure, limit s, what)
    ("second run", "ray_up->all_actors_ready", 15.0, "warm caches: Ray up to all actors ready"),
    ("resume", "ray_up->first_rollout_done", 20.0, "--resume: Ray up to its first rollout"),
    ("resume", "first_rollout_done", 20.0, "--resume: the command to its first rollout"),
)


def run_driver(args: list[str], env: dict[str, str], log: Path, timeout_s: float, cwd: Path = ROOT) -> dict[str, Any]:
    """``python driver.py ARGS`` in checkout ``cwd``; its start as the run recorded it (the last start in
    startup.json)."""
    cmd = [sys.executable, "driver.py", *args]
    started = time.time()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
                              check=False)
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; its output ({log}):\n{text[-4000:]}")
    run_dir = next((line.split("run directory: ", 1)[1].strip() for line in text.splitlines()
                    if "[rayrl] run directory: " in line), None)
    if run_dir is None:
        raise RuntimeError(f"no run directory in the output of {' '.join(cmd)} ({log})")
    starts = json.loads((Path(run_dir) / "startup.json").read_text())["starts"]
    start = starts[-1]
    if start["started_at"] < started - 5:
        raise RuntimeError(f"{run_dir}/startup.json has no start of this run")
    return {"run_dir": run_dir, **start}


def figures(start: dict[str, Any]) -> dict[str, float]:
    """The phases, and the spans the goals name."""
    phases = dict(start["phases"])
    out = {name: float(phases[name]) for name in PHASES if name in phases}
    if "ray_up" in phases:
        for end in ("all_actors_ready", "first_rollout_done", "first_step_trained"):
            if end in phases:
                out[f"ray_up->{end}"] = float(phases[end] - phases["ray_up"])
    return out


def one_round(scratch: Path, index: int, timeout_s: float) -> dict[str, dict[str, float]]:
    cache = scratch / f"cache-{index}"  # empty: the first run fills it
    env = {**os.environ, "RAYRL_CACHE": str(cache), "TORCH_EXTENSIONS_DIR": str(cache / "kernels")}
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own, as `python driver.py` on a laptop
    out = {}
    common = ["trainer.steps=1"]
    first = run_driver([*common, f"logging.output_dir={scratch / f'first-{index}'}"], env,
                       scratch / f"first-{index}.log", timeout_s)
    out["first run"] = figures(first)
    second = run_driver([*common, f"logging.output_dir={scratch / f'second-{index}'}"], env,
                        scratch / f"second-{index}.log", timeout_s)
    out["second run"] = figures(second)
    resumed = run_driver(["--config", str(Path(second["run_dir"]) / "config.yaml"), "--resume", "trainer.steps=2"],
                         env, scratch / f"resume-{index}.log", timeout_s)
    out["resume"] = figures(resumed)
    shutil.rmtree(cache, ignore_errors=True)  # the converted model is ~540 MB a round
    for run in RUNS:
        print(f"  round {index + 1} {run}: " + ", ".join(f"{k} {v:.1f}" for k, v in out[run].items()), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of first run, second run, resume")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="longest one run may take")
    add_common_args(ap)
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    record = Record("startup", "Time to the first trained step: first run, second run, --resume",
                    quick=args.quick, record_dir=args.record_dir)
    scratch = Path(tempfile.mkdtemp(prefix="rayrl-startup-"))
    samples: dict[str, dict[str, list[float]]] = {run: {} for run in RUNS}
    loads = []
    try:
        for index in range(rounds):
            loads.append(os.getloadavg()[0])
            for run, figs in one_round(scratch, index, args.timeout_s).items():
                for key, value in figs.items():
                    samples[run].setdefault(key, []).append(value)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    spreads = {run: {k: Spread(tuple(v)) for k, v in figs.items()} for run, figs in samples.items()}
    record.figure("phases", spreads)
    rows = []
    for name in (*PHASES, "ray_up->all_actors_ready", "ray_up->first_rollout_done", "ray_up->first_step_trained"):
        cells = [spreads[run][name].fmt(1) if name in spreads[run] else "" for run in RUNS]
        if any(cells):
            rows.append([name.replace("->", " -> "), *cells])
    record.table("seconds from the driver process's start (startup.json), median [IQR] (min-max, n) over rounds; "
                 "the parts start together, so each part's figure is when it was ready, not its share",
                 ["phase", *RUNS], rows)
    verdicts = []
    for run, key, limit, what in GOALS:
        got = spreads[run].get(key)
        if got is not None:
            verdicts.append([what, f"<= {limit:g} s", got.fmt(1), "MET" if got.median <= limit else "MISSED"])
    record.table("goals (issue 46), on the medians", ["goal", "limit", "measured", "verdict"], verdicts)
    record.note("python driver.py trainer.steps=1 on examples/calculator (the embedded default, otherwise unchanged); "
                "first run: RAYRL_CACHE and TORCH_EXTENSIONS_DIR empty (the model is converted, the decode kernels "
                "compiled); second run: the same caches warm; resume: --resume from the second run's checkpoint "
                "(trainer.steps=2). Each run starts its own local Ray. 1-minute load average at the start of each "
                f"round: {', '.join(f'{x:.2f}' for x in loads)}.")
    record.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
