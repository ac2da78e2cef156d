"""Plant known-wrong code one at a time and require the tests named for it to fail (a test is worth the wrong
code it catches).

The plants are data, one table per set, next to this runner: scripts/plants_gpu.py (``gpu``: SGLang
calls, schedule phases, the memory saver, Megatron; issue 41) and scripts/plants_formulas.py
(``formulas``: advantage estimators, policy losses, defaults, guards; issue 42). The runner copies the
checkout (tracked and untracked, not ignored, files) to a temporary directory once, checks that the copy
is what gets imported, runs the chosen plants' tests there unplanted (they must pass: a test that fails
anyway would count every plant as caught), then for each plant rewrites its ``old`` text (exactly once in
its file) to ``new``, runs its tests with ``PYTHONPATH`` and the working directory at the copy (engine
subprocesses and Ray workers run the planted code too), and restores the file, also when pytest times
out (its whole process group is killed) or fails to start. No bytecode is written and ``__pycache__``
is wiped after each restore, so a plant never outlives itself. A plant whose text is not there exactly
once is reported NOT PLANTED (the code moved: update the plant), never counted as caught. Prints one
table row per plant and test kind; exits 1 if any plant was missed or could not be planted.

    python scripts/mutation_check.py                        # every set, each plant's fast tests
    python scripts/mutation_check.py --set formulas -k gspo # the formula plants whose name has "gspo"
    python scripts/mutation_check.py --set gpu --slow       # also the whole-pipeline tests (minutes each)
    python scripts/mutation_check.py --only dtype-names,memory-tag --list
    python scripts/mutation_check.py --set formulas --skip 58   # all but the first 58 (a cut run goes on)

tests/test_mutation_check.py holds every plant to the source (fast) and runs each set (slow).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETS = {"gpu": "scripts.plants_gpu", "formulas": "scripts.plants_formulas"}  # set name -> module with PLANTS


@dataclass(frozen=True)
class Plant:
    """``old`` (exactly once in ``path``) becomes ``new``; ``fast`` tests must fail, and ``slow`` ones too
    when run with --slow. ``why`` says what real mistake the plant stands for."""

    name: str
    path: str
    old: str
    new: str
    why: str
    fast: tuple[str, ...] = ()
    slow: tuple[str, ...] = ()


@dataclass
class Outcome:
    """'failed', 'passed', or why neither (no tests ran, a timeout); the seconds; pytest's output tail."""

    result: str
    seconds: float
    output: str = ""


def plant_sets(names: list[str] | None = None) -> dict[str, tuple[Plant, ...]]:
    """The named plant sets (all when ``names`` is empty), in :data:`SETS` order."""
    if ROOT.as_posix() not in sys.path:
        sys.path.insert(0, ROOT.as_posix())
    return {name: importlib.import_module(module).PLANTS for name, module in SETS.items()
            if not names or name in names}


def copy_checkout(dest: Path) -> None:
    """Tracked and untracked (not ignored) files of the checkout, as they are on disk now."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def check_copy_is_used(copy: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(copy)}
    where = subprocess.run([sys.executable, "-c", "import rayrl, actors; print(rayrl.__file__, actors.__file__)"],
                           cwd=copy, env=env, capture_output=True, text=True, check=True).stdout.split()
    if not where or not all(Path(w).resolve().is_relative_to(copy.resolve()) for w in where):
        raise SystemExit(f"the copy's code is not the one imported ({where}): mutation results would be void")


def run_tests(copy: Path, tests: tuple[str, ...], timeout_s: float) -> Outcome:
    """Runs ``tests`` (whatever their marks: they are named) in ``copy``, first on the import path."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": f"{copy}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)}
    cmd = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "-m", "slow or not slow", *tests]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout ends engines and workers
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return Outcome("timed out", time.monotonic() - started, out[-3000:])
    seconds = time.monotonic() - started
    if proc.returncode == 0:
        return Outcome("passed", seconds, out[-3000:])
    if proc.returncode in (2, 3, 4, 5):  # interrupted, internal or usage error, nothing collected: not a catch
        return Outcome(f"no tests ran (pytest {proc.returncode}): {out.strip().splitlines()[-1:]}", seconds,
                       out[-3000:])
    return Outcome("failed", seconds, out[-3000:])


def run_planted(copy: Path, plant: Plant, tests: tuple[str, ...], timeout_s: float) -> Outcome | None:
    """Plants ``plant`` in ``copy``, runs ``tests`` and restores the file whatever happens; None when the
    plant's text is not in its file exactly once (nothing was run)."""
    target = copy / plant.path
    original = target.read_text() if target.exists() else ""
    if original.count(plant.old) != 1:
        return None
    target.write_text(original.replace(plant.old, plant.new))
    try:
        return run_tests(copy, tests, timeout_s)
    finally:
        target.write_text(original)
        for cache in copy.rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)


def choose(sets: dict[str, tuple[Plant, ...]], only: str, k: str, skip: int) -> list[tuple[str, Plant]]:
    """(set, plant) pairs: by exact names (--only), by a substring of the name (-k), then all but the first
    ``skip``."""
    names = set(filter(None, only.split(",")))
    chosen = [(s, p) for s, plants in sets.items() for p in plants
              if (not names or p.name in names) and k in p.name]
    return chosen[skip:]


def print_table(rows: list[tuple[str, str, str, str, str, float]]) -> None:
    width = max(len(r[1]) for r in rows)
    print(f"\n{'set':8}  {'plant':{width}}  {'file':38}  {'tests':5}  {'result':10}  seconds")
    for set_name, name, path, kind, verdict, seconds in rows:
        print(f"{set_name:8}  {name:{width}}  {path:38}  {kind:5}  {verdict:10}  {seconds:7.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", action="append", choices=list(SETS), dest="sets",
                    help="a plant set (repeatable; default: all)")
    ap.add_argument("--only", default="", help="comma-separated plant names")
    ap.add_argument("-k", default="", help="only the plants whose name contains this")
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N chosen plants (to finish a cut run)")
    ap.add_argument("--slow", action="store_true", help="also run each plant's slow (whole-pipeline) tests")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per pytest run (a plant's fast or slow tests)")
    ap.add_argument("--list", action="store_true", help="list the chosen plants and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unplanted run of the tests")
    args = ap.parse_args(argv)
    chosen = choose(plant_sets(args.sets), args.only, args.k, args.skip)
    if args.list or not chosen:
        for set_name, p in chosen:
            print(f"{set_name:8} {p.name:36} {p.path:34} {p.why}")
        print(f"{len(chosen)} plants")
        return 0 if chosen else 2
    kinds = ("fast", "slow") if args.slow else ("fast",)
    rows, bad = [], 0
    with tempfile.TemporaryDirectory(prefix="rayrl-mutation-") as tmp:
        copy = Path(tmp)
        copy_checkout(copy)
        check_copy_is_used(copy)
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for _, p in chosen for kind in kinds for t in getattr(p, kind)))
            base = run_tests(copy, tests, args.timeout_s)
            print(f"unplanted: {base.result} in {base.seconds:.0f} s; {len(chosen)} plants", flush=True)
            if base.result != "passed":
                print("the tests fail without a plant: fix that first (nothing is counted)")
                print(base.output)
                return 1
        for i, (set_name, p) in enumerate(chosen, 1):
            for kind in kinds:
                tests = getattr(p, kind)
                if not tests:
                    continue
                outcome = run_planted(copy, p, tests, args.timeout_s)
                if outcome is None:
                    rows.append((set_name, p.name, p.path, "-", "NOT PLANTED (text not found once: update the plant)",
                                 0.0))
                    bad += 1
                    print(f"[{i}/{len(chosen)}] {p.name}: NOT PLANTED ({p.path})", flush=True)
                    break
                verdict = "CAUGHT" if outcome.result == "failed" else f"MISSED ({outcome.result})"
                bad += verdict != "CAUGHT"
                rows.append((set_name, p.name, p.path, kind, verdict, outcome.seconds))
                print(f"[{i}/{len(chosen)}] {p.name} [{kind}]: {verdict} in {outcome.seconds:.0f} s", flush=True)
    print_table(rows)
    print(f"\n{len(rows) - bad} of {len(rows)} caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT.as_posix())
    from scripts.mutation_check import main as _main  # the plant tables import Plant from this module's name

    sys.exit(_main())
