"""Plant known-wrong GPU-path calls one at a time and require the tests to fail for each (issue 41).

Each plant rewrites one piece of source text in a temporary copy of the checkout (tracked and untracked,
not ignored, files) and runs the tests named for it there (``PYTHONPATH`` and the working directory
point at the copy, so engine subprocesses and Ray workers run the planted code too); it is caught when
they fail. First the same tests run once without a plant and must pass. A plant whose text is no longer
in the source is reported as such (the code moved: update the plant), never counted as caught. Prints
one table row per plant; exits 1 if any plant was missed or could not be planted.

    python scripts/mutation_check.py              # every plant, its fast tests
    python scripts/mutation_check.py --slow       # also the whole-pipeline tests (minutes each)
    python scripts/mutation_check.py --only dtype-names,memory-tag --list

docs/gpu.md says which plants exist and what catches them; tests/test_mutation_check.py runs it (slow).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAST_OUTPUT = ""  # the last pytest run's output, shown when the unplanted run fails
STANDIN = "tests/engines/test_sglang_standin.py"
PHASES = "tests/test_schedule_phases.py"
SCHEDULES = "tests/pipeline/test_schedules_e2e.py"
CLIENT_CONTRACT = "tests/contracts/test_sglang_contract.py"
COLOCATED = f"{SCHEDULES}::test_colocated_async_two_steps_pauses_engines_in_order"


@dataclass(frozen=True)
class Plant:
    """``old`` (exactly once in ``path``) becomes ``new``; ``fast`` tests must fail, and ``slow`` ones too
    when run with --slow."""

    name: str
    path: str
    old: str
    new: str
    why: str
    fast: tuple[str, ...] = ()
    slow: tuple[str, ...] = ()


PLANTS = (
    Plant("dtype-names", "rayrl/weights/group.py",
          'return str(dtype).removeprefix("torch.")', "return str(dtype)",
          'dtypes sent as "torch.bfloat16": SGLang resolves getattr(torch, dtype)',
          fast=(f"{STANDIN}::test_the_broadcast_sender_sends_what_sglang_resolves",),
          slow=(f"{SCHEDULES}::test_colocated_async_releases_the_broadcast_group_before_the_trainer_lends_its_gpu",)),
    Plant("memory-tag", "rayrl/pipeline/schedules.py",
          'resume_memory_occupation(["kv_cache", "cuda_graph"])',
          'resume_memory_occupation(["kv_cache", "cuda_graphs"])',
          'resume tag "cuda_graphs": a KeyError in SGLang\'s scheduler (offload_tags.remove)',
          fast=(PHASES,), slow=(COLOCATED,)),
    Plant("resume-not-released", "rayrl/pipeline/schedules.py",
          "        parts.engines.wait_idle()  # SGLang asserts no request is running on release\n"
          "        parts.engines.release_memory_occupation()\n",
          "        parts.engines.wait_idle()  # SGLang asserts no request is running on release\n",
          "the engines' weights resumed without a release: a KeyError in SGLang's scheduler",
          fast=(PHASES,), slow=(COLOCATED,)),
    Plant("no-push-at-setup", "rayrl/pipeline/schedules.py",  # issue 41 B
          "        self.devices_with_trainer = True\n        self.engines_take_devices()\n",
          "        self.devices_with_trainer = False\n        parts.weights.release_groups()\n"
          "        parts.trainer.offload()\n        parts.engines.resume_memory_occupation()\n",
          "colocated setup resumes the engines with no push (B): SGLang generates from garbage",
          fast=(PHASES,), slow=(COLOCATED,)),
    Plant("no-push-after-resume", "rayrl/pipeline/schedules.py",
          '        parts.engines.resume_memory_occupation(["weights"])\n'
          "        self.membership.push_weights(self.state.version)",
          '        parts.engines.resume_memory_occupation(["weights"])\n        pass',
          "weights resumed without a push: SGLang (no CPU backup) generates from garbage",
          fast=(PHASES,), slow=(COLOCATED,)),
    Plant("save-while-offloaded", "rayrl/pipeline/schedules.py",  # issue 41 C, D
          "        if self.devices_with_trainer:\n            return fn()\n        self.give_devices_to_trainer()\n",
          "        if True:\n            return fn()\n        self.give_devices_to_trainer()\n",
          "checkpoint save and resume load run on the offloaded trainer (C, D)",
          fast=(f"{PHASES}::test_colocated_async_saves_and_loads_checkpoints_with_the_trainer_onloaded",),
          slow=(COLOCATED,)),
    Plant("replacement-from-offloaded", "rayrl/pipeline/schedules.py",  # issue 41 E
          "        self.with_trainer_memory(lambda: None)\n",
          "        self.membership.push_weights(self.state.version)\n",
          "a replacement engine's weights read from the offloaded trainer (E)",
          fast=(f"{PHASES}::test_colocated_async_a_replacement_engine_gets_weights_from_the_onloaded_trainer",)),
    Plant("no-idle-wait-before-update", "rayrl/pipeline/schedules.py",  # issue 41 F
          "            parts.engines.wait_idle()  # aborted requests leave the batch at the next scheduler step\n",
          "",
          "an update that flushes right after an abort pause (F): SGLang's idle assertion kills it",
          fast=(PHASES,), slow=(f"{SCHEDULES}::test_async_two_steps_drops_stale_groups",)),
    Plant("no-idle-wait-before-release", "rayrl/pipeline/schedules.py",  # issue 41 F
          "        parts.engines.wait_idle()  # SGLang asserts no request is running on release\n",
          "",
          "a release right after the pause (F): SGLang asserts no request runs, and its scheduler dies",
          fast=(PHASES,), slow=(COLOCATED,)),
    Plant("ld-preload-prepended", "rayrl/trainers/memory_saver.py",  # issue 41 G
          '    return {"LD_PRELOAD": hook}',
          '    return {"LD_PRELOAD": ":".join([hook, *others])}',
          "the saver's hook prepended to an existing LD_PRELOAD (G): torch_memory_saver loads it as one library",
          fast=("tests/test_memory_saver_cpu.py::test_preload_env_gives_torch_memory_saver_exactly_its_own_library",)),
    Plant("unknown-field", "rayrl/engines/client.py",
          '            "flush_cache": flush_cache,\n            "abort_all_requests": abort_all_requests,\n        }\n'
          "        if weight_version is not None:\n            payload[\"weight_version\"] = str(weight_version)\n"
          '        return await self._request("POST", "/update_weights_from_tensor", payload, timeout_s=timeout_s)',
          '            "flush": flush_cache,\n            "abort_all_requests": abort_all_requests,\n        }\n'
          "        if weight_version is not None:\n            payload[\"weight_version\"] = str(weight_version)\n"
          '        return await self._request("POST", "/update_weights_from_tensor", payload, timeout_s=timeout_s)',
          "a field SGLang's request class lacks (FastAPI drops it: the flag is lost)",
          fast=(f"{CLIENT_CONTRACT}::test_every_route_and_field_we_send_exists_in_the_pinned_source",
                f"{STANDIN}::test_while_paused_an_update_applies_at_once_and_abort_mode_returns_running_generations"),
          slow=(f"{SCHEDULES}::test_sync_two_steps_on_the_strict_stand_in",)),
    Plant("removed-version-route", "rayrl/engines/client.py",
          'return await self._request("GET", "/model_info", timeout_s=30.0)',
          'return await self._request("GET", "/get_weight_version", timeout_s=30.0)',
          "the version read from /get_weight_version, a 404 on SGLang 0.5.9",
          fast=(f"{STANDIN}::test_removed_version_route_answers_404_and_every_transport_verifies_through_model_info",)),
    Plant("megatron-load-not-loading", "rayrl/trainers/megatron_checkpoint.py",
          "dist_checkpointing.load(sharded_state(model, optimizer, is_loading=True)",
          "dist_checkpointing.load(sharded_state(model, optimizer, is_loading=False)",
          "Megatron's load told is_loading=False: the optimizer's layout is the save's, not the load's",
          fast=("tests/contracts/test_megatron_contract.py::test_the_optimizer_load_is_told_it_is_loading",)),
)


def copy_checkout(dest: Path) -> None:
    """Tracked and untracked (not ignored) files of the checkout, as they are on disk now."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def plant(copy: Path, p: Plant) -> bool:
    target = copy / p.path
    text = target.read_text() if target.exists() else ""
    if text.count(p.old) != 1:
        return False
    target.write_text(text.replace(p.old, p.new))
    return True


def run_tests(copy: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[str, float]:
    """'failed', 'passed' or why neither (no tests ran, a timeout), and the seconds it took."""
    env = {**os.environ, "PYTHONPATH": f"{copy}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)}
    cmd = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "-m", "slow or not slow", *tests]
    started = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timed out", time.monotonic() - started
    seconds = time.monotonic() - started
    global LAST_OUTPUT
    LAST_OUTPUT = out.stdout + out.stderr
    if out.returncode == 0:
        return "passed", seconds
    if out.returncode in (4, 5):  # usage error, nothing collected: not a failure the plant caused
        return f"no tests ran (pytest {out.returncode}): {out.stdout.strip().splitlines()[-1:]}", seconds
    return "failed", seconds


def check_copy_is_used(copy: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(copy)}
    where = subprocess.run([sys.executable, "-c", "import rayrl, actors; print(rayrl.__file__, actors.__file__)"],
                           cwd=copy, env=env, capture_output=True, text=True, check=True).stdout.split()
    if not all(Path(w).resolve().is_relative_to(copy.resolve()) for w in where):
        raise SystemExit(f"the copy's code is not the one imported ({where}): mutation results would be void")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated plant names")
    ap.add_argument("--slow", action="store_true", help="also run each plant's whole-pipeline tests")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per plant and test set")
    ap.add_argument("--list", action="store_true", help="list the plants and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unplanted run of the tests")
    args = ap.parse_args(argv)
    chosen = [p for p in PLANTS if not args.only or p.name in args.only.split(",")]
    if args.list or not chosen:
        for p in PLANTS:
            print(f"{p.name:28} {p.path:38} {p.why}")
        return 0 if chosen else 2
    rows, bad = [], 0
    with tempfile.TemporaryDirectory(prefix="rayrl-mutation-") as tmp:
        clean = Path(tmp) / "unplanted"
        copy_checkout(clean)
        check_copy_is_used(clean)
        if not args.no_baseline:  # a test that fails unplanted would count every plant as caught
            tests = tuple(dict.fromkeys(t for p in chosen for t in (*p.fast, *(p.slow if args.slow else ()))))
            result, seconds = run_tests(clean, tests, args.timeout_s)
            print(f"unplanted: {result} in {seconds:.0f} s", flush=True)
            if result != "passed":
                print("the tests fail without a plant: fix that first (nothing is counted)")
                print(LAST_OUTPUT[-3000:])
                return 1
        shutil.rmtree(clean, ignore_errors=True)
        for p in chosen:
            copy = Path(tmp) / p.name
            copy_checkout(copy)
            if not plant(copy, p):
                rows.append((p.name, p.path, "-", "NOT PLANTED (text not found once: update the plant)", 0.0))
                bad += 1
                continue
            for kind, tests in (("fast", p.fast), ("slow", p.slow if args.slow else ())):
                if not tests:
                    continue
                result, seconds = run_tests(copy, tests, args.timeout_s)
                verdict = "CAUGHT" if result == "failed" else f"MISSED ({result})"
                bad += verdict != "CAUGHT"
                rows.append((p.name, p.path, kind, verdict, seconds))
                print(f"{p.name} [{kind}]: {verdict} in {seconds:.0f} s", flush=True)
            shutil.rmtree(copy, ignore_errors=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'plant':{width}}  {'file':38}  {'tests':5}  {'result':10}  seconds")
    for name, path, kind, verdict, seconds in rows:
        print(f"{name:{width}}  {path:38}  {kind:5}  {verdict:10}  {seconds:7.0f}")
    print(f"\n{len(rows) - bad} of {len(rows)} caught" if rows else "nothing ran")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
