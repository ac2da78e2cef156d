"""The learning comparison of docs/results/algorithms.md: whole training runs of examples/files, one per
(side, seed), then curves and a table from their metrics.

    python scripts/compare_algorithms.py run grpo 0        # one run: runs/algo-grpo-s0 (~12 min on 2 cores)
    python scripts/compare_algorithms.py run grpo 0 5      # a reduced run: 5 steps, held-out eval at 0 and 5
    python scripts/compare_algorithms.py report            # PNGs + the tables, from every finished run
                                                           # (and the distillation run's, runs/files-distill)
    python scripts/compare_algorithms.py report /other/checkout/runs   # the same, from runs made elsewhere

A side is a few config overrides (:data:`SIDES`); every side runs the committed examples/files config
with the same seeds, the same tasks in the same order and the same budget (:data:`STEPS` steps of 2
tasks x 8 episodes, or fewer; the dynamic-sampling side: the same episodes, ``pipeline.episode_budget``). Runs are
separate processes so that each can wait for a quiet machine; the checkpoint each run writes at its end
is deleted (1.6 GB each, and nothing resumes from it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "files" / "config.yaml"
OUT = ROOT / "docs" / "results"
STEPS = 10  # the committed config's; a reduced run passes fewer and is evaluated at step 0 and its end only
EPISODES_PER_STEP = 2 * 8  # 2 tasks x 8 episodes

SIDES: dict[str, list[str]] = {
    "grpo": ["algorithm.advantage_estimator=grpo", "algorithm.policy_loss=ppo_clip"],
    "dr_grpo": ["algorithm.advantage_estimator=dr_grpo", "algorithm.policy_loss=ppo_clip"],
    "rloo": ["algorithm.advantage_estimator=rloo", "algorithm.policy_loss=ppo_clip"],
    # tis_cap 2.0: resolve's default for gspo since f960102 (said here for checkouts before it)
    "gspo": ["algorithm.advantage_estimator=grpo", "algorithm.policy_loss=gspo", "algorithm.tis_cap=2.0"],
    "grpo+dynamic_sampling": ["algorithm.advantage_estimator=grpo", "algorithm.dynamic_sampling=true"],
}


def exp_id(side: str, seed: int) -> str:
    return f"algo-{side.replace('+', '-')}-s{seed}"


def run(side: str, seed: int, steps: int = STEPS) -> int:
    overrides = [f"exp_id={exp_id(side, seed)}", f"seed={seed}", "logging.inspect_episodes_per_step=0", *SIDES[side]]
    if steps != STEPS:
        overrides.append(f"pipeline.eval_interval={steps}")
    if side.endswith("dynamic_sampling"):  # the same episodes as the others; the budget, not the steps, ends it
        overrides += [f"pipeline.episode_budget={steps * EPISODES_PER_STEP}", f"trainer.steps={4 * steps}"]
    else:
        overrides.append(f"trainer.steps={steps}")
    code = subprocess.call([sys.executable, str(ROOT / "driver.py"), "--config", str(CONFIG), *overrides], cwd=ROOT)
    shutil.rmtree(ROOT / "runs" / exp_id(side, seed) / "checkpoints", ignore_errors=True)
    return code


RUNS = ROOT / "runs"  # where ``report`` reads finished runs (its optional argument replaces it)


def load(side: str, seed: int) -> list[dict] | None:
    path = RUNS / exp_id(side, seed) / "metrics.jsonl"
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text().splitlines()]


def curves(rows: list[dict]) -> dict[str, list]:
    """Per training step: cumulative episodes, train reward, whether it trained; per evaluation: the
    episodes consumed before it and the held-out success."""
    steps = [r for r in rows if "rollout/episodes" in r]
    evals = [r for r in rows if "eval/success_rate" in r]
    episodes_at = {0: 0}
    total = 0
    for r in steps:
        total += r["rollout/episodes"]
        episodes_at[r["step"]] = total
    return {
        "episodes": [episodes_at[r["step"]] for r in steps],
        "reward": [r.get("rollout/reward_mean", float("nan")) for r in steps],
        "trained": [r.get("train/trained_samples", 0) > 0 for r in steps],
        "eval_episodes": [episodes_at.get(r["step"], total) for r in evals],
        "eval_success": [r["eval/success_rate"] for r in evals],
        "clip": [r.get("train/clip_fraction") for r in steps if r.get("train/trained_samples", 0) > 0],
        "dropped": sum(r.get("pipeline/dynamic_dropped_groups", 0) for r in steps),
    }


def report() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = {(side, seed): c for side in SIDES for seed in (0, 1) if (rows := load(side, seed)) and (c := curves(rows))}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = dict(zip(SIDES, ("C0", "C1", "C2", "C3", "C4")))
    for (side, seed), c in sorted(found.items()):
        style = "-" if seed == 0 else "--"
        axes[0].plot(c["eval_episodes"], c["eval_success"], style, marker="o", color=colours[side],
                     label=f"{side} seed {seed}")
        axes[1].plot(c["episodes"], c["reward"], style, color=colours[side], alpha=0.8, label=f"{side} seed {seed}")
    axes[0].set(xlabel="training episodes", ylabel="held-out success (32 tasks)", title="held-out success")
    axes[1].set(xlabel="training episodes", ylabel="mean reward of the step's episodes", title="train reward")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "algorithms_curves.png", dpi=110)
    print("| side | seed | held-out success | steps that trained | mean clip fraction | groups dropped |")
    print("|---|---|---|---|---|---|")
    for (side, seed), c in sorted(found.items()):
        evals = " / ".join(f"{s:.3f}" for s in c["eval_success"])
        clip = sum(c["clip"]) / len(c["clip"]) if c["clip"] else 0.0
        print(f"| {side} | {seed} | {evals} (at {', '.join(map(str, c['eval_episodes']))}) | "
              f"{sum(c['trained'])} of {len(c['trained'])} | {clip:.3f} | {c['dropped']} |")
    print()
    print("| side | seeds | held-out at the start, mean | held-out at the end, mean [each seed] "
          "| steps that trained, all seeds |")
    print("|---|---|---|---|---|")
    for side in SIDES:
        runs = [(seed, c) for (s, seed), c in sorted(found.items()) if s == side]
        if not runs:
            continue
        start = sum(c["eval_success"][0] for _, c in runs) / len(runs)
        ends = [c["eval_success"][-1] for _, c in runs]
        each = ", ".join(f"seed {seed}: {end:.3f}" for (seed, _), end in zip(runs, ends))
        trained = sum(sum(c["trained"]) for _, c in runs)
        steps = sum(len(c["trained"]) for _, c in runs)
        print(f"| {side} | {len(runs)} | {start:.3f} | {sum(ends) / len(ends):.3f} [{each}] | {trained} of {steps} |")


def report_distillation() -> None:
    """The distillation run (examples/distill/config.yaml): the sampled reverse KL to the teacher per step,
    and held-out success, from runs/files-distill/metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = RUNS / "files-distill" / "metrics.jsonl"
    if not path.is_file():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in rows if "distill/reverse_kl" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in steps], [r["distill/reverse_kl"] for r in steps], marker="o")
    ax.set(xlabel="step (the student's samples of that step, scored before its update)",
           ylabel="mean sampled reverse KL, nats/token", title="student -> teacher reverse KL")
    fig.tight_layout()
    fig.savefig(OUT / "algorithms_distill_kl.png", dpi=110)
    print("| step | reverse KL | student log-prob | teacher log-prob | train reward |")
    print("|---|---|---|---|---|")
    for r in steps:
        print(f"| {r['step']} | {r['distill/reverse_kl']:.3f} | {r['distill/student_logprob']:.3f} | "
              f"{r['distill/teacher_logprob']:.3f} | {r.get('rollout/reward_mean', float('nan')):.3f} |")
    print("held-out:", [(r["step"], r["eval/success_rate"]) for r in rows if "eval/success_rate" in r])


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        sys.exit(run(sys.argv[2], int(sys.argv[3]), *map(int, sys.argv[4:5])))
    if sys.argv[2:3]:
        RUNS = Path(sys.argv[2]).resolve()
    report()
    report_distillation()
