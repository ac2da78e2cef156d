"""A warm start, or a ``--resume``, of one commit against another, in alternation: did a change to the start help?

    python bench/startup_ab.py --against REF [--this REF2] [--resume] [--rounds 3]

bench/startup.py's runs cannot alternate (a first run, a second, a resume: each needs the one before), and
the load of a shared machine moves more between two bench runs than a change to the start does. Here each
round runs the start once in a git worktree of ``REF`` and once in this checkout (or a worktree of
``--this``, so that a queued run measures a fixed commit while the checkout moves on), the order rotating
(bench/measure.py), with the user's warm caches (``RAYRL_CACHE``, as a second run has them) and
``PYTHONPATH`` set to each side's tree, so the driver, Ray's workers and the engine's process all import
that side's code. The figures are each run's own (``startup.json``, rayrl/startup.py): every phase, from
the driver process's start.

- default: ``python driver.py trainer.steps=0`` (every part started and wired, no step: the start alone);
  the figure compared is Ray up -> all actors ready;
- ``--resume``: each side first runs ``trainer.steps=1`` once (its checkpoint; not measured), then each
  round resumes it, ``python driver.py --config RUN/config.yaml --resume trainer.steps=2``, and stops it
  with SIGINT (the driver shuts its actors and Ray down) once its first rollout is recorded: the step that
  follows is the trainer's, which the start does not change. The same checkpoint is resumed every round (a
  run stopped before its step trains saves nothing). The figure compared is the command to the first
  rollout (issue 46's goal: <= 20 s); the checkpoint's own figures (the trainer's preload, the wait for the
  trainer after every part was up, the weight push) come from ``checkpoint_loaded``'s details.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from measure import ROOT, Record, add_common_args, alternate, paired_ratio
from startup import PHASES, run_driver

DETAILS = ("ray_up.init_s", "checkpoint_loaded.preload_s", "checkpoint_loaded.trainer_load_s",
           "checkpoint_loaded.weight_push_s")
SPANS = (("ray_up", "all_actors_ready"), ("all_actors_ready", "checkpoint_loaded"),
         ("checkpoint_loaded", "first_rollout_done"), ("ray_up", "first_rollout_done"))


def flatten(start: dict[str, Any]) -> dict[str, float]:
    """A start's phases, the spans between some of them and the details named in :data:`DETAILS`."""
    phases = {k: float(v) for k, v in start["phases"].items()}
    out = {name: phases[name] for name in PHASES if name in phases}
    for a, b in SPANS:
        if a in phases and b in phases:
            out[f"{a}->{b}"] = phases[b] - phases[a]
    for key in DETAILS:
        phase, _, detail = key.partition(".")
        value = start.get("details", {}).get(phase, {}).get(detail)
        if value is not None:
            out[key] = float(value)
    return out


def interruptible() -> None:
    """In the driver's process before it starts: SIGINT back to its default, so that Python turns it into
    KeyboardInterrupt (a command started in the background of a shell, as the heavy queue does, inherits
    SIGINT ignored, and the driver would train and checkpoint the step instead of stopping)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def same_checkpoints(run_dir: Path, kept: Path) -> None:
    """Put ``run_dir``'s checkpoints back as ``kept`` holds them (hard links: a save writes new files and
    never rewrites one), should a resumed run have trained and saved its step before it stopped."""
    now = run_dir / "checkpoints"
    if sorted(p.name for p in now.iterdir()) != sorted(p.name for p in kept.iterdir()):
        shutil.rmtree(now)
        shutil.copytree(kept, now, copy_function=os.link)


def resume_until_rollout(tree: Path, run_dir: Path, env: dict[str, str], log: Path, timeout_s: float) -> dict:
    """``--resume`` the run in ``run_dir`` from ``tree``; SIGINT once startup.json records its first rollout."""
    cmd = [sys.executable, "driver.py", "--config", str(run_dir / "config.yaml"), "--resume", "trainer.steps=2"]
    record = run_dir / "startup.json"
    launched = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=interruptible)
        start = None
        try:
            while time.time() - launched < timeout_s and proc.poll() is None:
                time.sleep(0.2)
                try:
                    last = json.loads(record.read_text())["starts"][-1]
                except (OSError, ValueError, KeyError, IndexError):
                    continue
                if last["started_at"] >= launched - 5 and "first_rollout_done" in last["phases"]:
                    start = last
                    proc.send_signal(signal.SIGINT)
                    break
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if start is None:
        raise RuntimeError(f"{' '.join(cmd)} (in {tree}) recorded no first rollout; its output ({log}):\n"
                           f"{log.read_text(errors='replace')[-4000:]}")
    return start


def side(tree: Path, scratch: Path, name: str, timeout_s: float, resume: bool) -> Callable[[], dict[str, float]]:
    runs = iter(range(10**6))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("RAY_ADDRESS", None)
    checkpointed: list[Path] = []

    def run() -> dict[str, float]:
        i = next(runs)
        if not resume:
            return flatten(run_driver(["trainer.steps=0", f"logging.output_dir={scratch / f'{name}-{i}'}"], env,
                                      scratch / f"{name}-{i}.log", timeout_s, cwd=tree))
        if not checkpointed:  # the run every round resumes: one step and its checkpoint
            first = run_driver(["trainer.steps=1", f"logging.output_dir={scratch / f'{name}-ckpt'}"], env,
                               scratch / f"{name}-ckpt.log", timeout_s, cwd=tree)
            checkpointed.append(Path(first["run_dir"]))
            shutil.copytree(checkpointed[0] / "checkpoints", scratch / f"{name}-kept", copy_function=os.link)
        same_checkpoints(checkpointed[0], scratch / f"{name}-kept")
        return flatten(resume_until_rollout(tree, checkpointed[0], env, scratch / f"{name}-resume-{i}.log",
                                            timeout_s))

    return run


def worktree(ref: str, where: Path) -> str:
    short = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    subprocess.run(["git", "worktree", "add", "--detach", str(where), short], cwd=ROOT, check=True,
                   capture_output=True)
    return short


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="the commit (or branch) to compare with (before)")
    ap.add_argument("--this", default=None, help="the commit to measure as after (default: this checkout as it is)")
    ap.add_argument("--resume", action="store_true", help="time --resume to its first rollout (module docstring)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds after one warm-up round (its figures dropped)")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    add_common_args(ap)
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="rayrl-startup-ab-"))
    trees = []
    try:
        ref = worktree(args.against, scratch / "before")
        trees.append(scratch / "before")
        after_tree, after = ROOT, "this checkout"
        if args.this:
            after = worktree(args.this, scratch / "after")
            after_tree = scratch / "after"
            trees.append(after_tree)
        what = "--resume to its first rollout" if args.resume else "a warm start"
        record = Record("startup_ab" + ("_resume" if args.resume else ""), f"{what}: {after} against {ref}, "
                        "alternating", quick=args.quick, record_dir=args.record_dir)
        rounds = 2 if args.quick else args.rounds
        result = alternate({ref: side(scratch / "before", scratch, "before", args.timeout_s, args.resume),
                            after: side(after_tree, scratch, "after", args.timeout_s, args.resume)},
                           min_rounds=rounds, max_rounds=rounds, warmup=1, label="startup")
    finally:
        for tree in trees:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    record.figure("result", result)
    key = "first_rollout_done" if args.resume else "ray_up->all_actors_ready"
    ratio = paired_ratio(result[after][key], result[ref][key])
    names = [n for n in (*PHASES, *(f"{a}->{b}" for a, b in SPANS), *DETAILS)
             if any(n in figs for figs in result.values())]
    command = ("python driver.py --config RUN/config.yaml --resume trainer.steps=2, stopped at its first rollout"
               if args.resume else "python driver.py trainer.steps=0")
    record.table(f"{command}; warm caches; seconds from the driver process's start (startup.json), median [IQR] "
                 "(min-max, n) over alternating rounds after a warm-up round",
                 ["phase", ref, after],
                 [[n.replace("->", " -> "), *(figs[n].fmt(1) if n in figs else "" for figs in result.values())]
                  for n in names] + [[f"ratio {after} / {ref}, {key.replace('->', ' -> ')} (per round)", "",
                                      ratio.fmt(2)]])
    if args.resume:
        got = result[after][key]
        record.note(f"goal (issue 46): --resume, the command to its first rollout <= 20 s: {got.fmt(1)}, "
                    f"{'MET' if got.median <= 20 else 'MISSED'} on the median.")
    record.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
