"""Pipeline schedules side by side: sync, async and colocated_async on the calculator task, on CPU.

Each tool call also sleeps in its sandbox (``rollout.tool_delay_s``, default 1-3 s), as real tools do
(builds, tests, web requests). In ``sync`` the trainer waits for the slowest episode and the episodes
wait for the trainer; the async schedules keep ``pipeline.groups_in_flight`` groups going, so tool time
overlaps training and generation. Same model, data, seed and config for all three; only
``pipeline.schedule`` differs. Runs one after another in one Ray session.

Reported per schedule: episodes/s and mean step time over the steady steps (step 1, which includes
warm-up, is left out), both as ratios against sync; mean staleness of the trained samples (policy
versions behind the weights they trained); dropped stale groups; the share of wall time the engine
spent in forward passes; the reward per step (plot). For sync it also prints how much of its time the
engine or the trainer computes: the part no schedule can overlap away on the same cores.
Target: colocated_async >= 1.8x sync episodes/s with reward curves that match within noise.

With ``--rounds`` N the schedules take turns N times, the order rotating each round (bench/measure.py);
every figure is then a median with its spread, and a ratio the median of per-round ratios. Each run is
a whole training run (minutes on 2 cores), which is why ``make bench`` leaves this bench out.

    python bench/pipeline_overlap.py [--model smollm2-135m-instruct] [--steps 6] [--tool-delay 1 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from measure import Record, add_common_args, alternate, paired_ratio

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("sync", "async", "colocated_async")


NUMERIC = ("episodes_per_s", "step_s", "staleness_mean", "dropped_groups", "train_s", "engine_busy",
           "trainer_busy")


def run_schedule(schedule: str, args: argparse.Namespace, out_dir: Path, tag: str) -> dict[str, Any]:
    from actors.pipeline import Pipeline
    from rayrl.config import load_config

    cfg = load_config(
        ROOT / "examples" / "calculator" / "config.yaml",
        [
            f"exp_id=overlap-{schedule}-{tag}",
            f"model.path={args.model}",
            f"logging.output_dir={out_dir}",
            "logging.tensorboard=false",
            "logging.plot=false",
            f"pipeline.schedule={schedule}",
            f"pipeline.max_staleness={args.max_staleness}",
            f"pipeline.partial_rollout={str(args.partial_rollout).lower()}",
            f"rollout.tool_delay_s=[{args.tool_delay[0]},{args.tool_delay[1]}]",
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.group}",
            f"trainer.steps={args.steps}",
            f"seed={args.seed}",
        ],
    )
    pipeline = Pipeline(cfg)
    try:
        history = []
        ends = []
        started = time.monotonic()
        while pipeline.step < args.steps:
            history.append(pipeline.run_step())
            ends.append(time.monotonic())
        steady = history[1:]
        steady_s = ends[-1] - ends[0]
        episodes = sum(h["rollout/episodes"] for h in steady)
        return {
            "schedule": schedule,
            "episodes_per_s": episodes / steady_s,
            "step_s": statistics.mean(h["time/step_s"] for h in steady),
            "staleness_mean": statistics.mean(h["pipeline/staleness_mean"] for h in history),
            "dropped_groups": sum(h.get("pipeline/dropped_stale_groups", 0) for h in history),
            "rewards": [h.get("rollout/reward_mean") for h in history],
            "tool_calls": [h["rollout/tool_calls_mean"] for h in history],
            "total_s": ends[-1] - started,
            "train_s": statistics.mean(h.get("time/train_s", 0.0) for h in steady),
            "pause_s": statistics.mean(h.get("time/engine_pause_s", 0.0) for h in steady),
            "engine_busy": sum(h.get("engine/prefill_s", 0.0) + h.get("engine/decode_s", 0.0) for h in steady)
            / max(sum(h["time/step_s"] for h in steady), 1e-9),
            "trainer_busy": sum(h.get("train/train_time_s", 0.0) for h in steady)
            / max(sum(h["time/step_s"] for h in steady), 1e-9),
            "gateway_queued": history[-1].get("gateway/queued", 0),
            "gateway_continued": history[-1].get("gateway/continued", 0),
        }
    finally:
        pipeline.shutdown()


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=110)
    for r in results:
        ax.plot(range(1, len(r["rewards"]) + 1), r["rewards"], marker="o", label=r["schedule"])
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (train episodes)")
    ax.set_title("calculator, SmolLM2-135M, CPU: reward per step by schedule")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=2, help="rollout.prompts_per_step")
    ap.add_argument("--group", type=int, default=4, help="rollout.group_size")
    ap.add_argument("--tool-delay", type=float, nargs=2, default=[1.0, 3.0], metavar=("MIN", "MAX"))
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--partial-rollout", action=argparse.BooleanOptionalAction, default=True,
                    help="colocated_async: abort generations at the switch and continue them (else drain)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--rounds", type=int, default=3, help="runs per schedule, alternating")
    ap.add_argument("--out", default="runs/bench-overlap")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "results" / "pipeline_overlap.png"))
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.prompts, args.group, args.tool_delay, args.rounds = 2, 1, 2, [0.1, 0.2], 1
    if args.steps < 2:
        ap.error("--steps must be at least 2 (step 1 is warm-up)")

    import ray

    from rayrl.models import resolve_model_path

    record = Record("pipeline_overlap", "Pipeline schedules side by side (calculator, CPU)", quick=args.quick,
                    record_dir=args.record_dir)
    args.model = str(resolve_model_path(args.model))
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.schedules}

    def side(schedule: str):
        def go() -> dict[str, float]:
            r = run_schedule(schedule, args, Path(args.out), tag=str(len(runs[schedule])))
            runs[schedule].append(r)
            return {k: float(r[k]) for k in NUMERIC}
        return go

    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        res = alternate({s: side(s) for s in args.schedules}, min_rounds=args.rounds, max_rounds=args.rounds,
                        warmup=0, label="schedules")
    finally:
        ray.shutdown()
    base = "sync" if "sync" in res else args.schedules[0]
    rows = []
    for name, r in res.items():
        rows.append([name, r["episodes_per_s"].fmt(3), paired_ratio(r["episodes_per_s"], res[base]["episodes_per_s"])
                     .fmt(2, "x"), r["step_s"].fmt(1), r["train_s"].fmt(1), r["staleness_mean"].fmt(2),
                     r["dropped_groups"].fmt(0), r["engine_busy"].scaled(lambda x: 100 * x).fmt(0, "%"),
                     " | ".join(" ".join(f"{x:.2f}" for x in run["rewards"]) for run in runs[name])])
    record.table(f"{args.steps} steps x {args.prompts} prompts x {args.group} episodes, tool delay "
                 f"{args.tool_delay[0]:g}-{args.tool_delay[1]:g} s, max_staleness {args.max_staleness}; steady "
                 f"steps 2..{args.steps}; median [IQR] (min-max, n) over {args.rounds} alternating runs",
                 ["schedule", "episodes/s", f"x {base}", "step s", "train s", "staleness", "dropped groups",
                  "engine busy", "reward per step (each run)"], rows)
    if base == "sync":
        busy = [e + t for e, t in zip(res["sync"]["engine_busy"].samples, res["sync"]["trainer_busy"].samples)]
        record.note(f"sync keeps the engine or the trainer computing {statistics.median(busy):.0%} of its wall time "
                    f"(median over runs; they take turns on the same cores): a schedule that only overlaps waiting "
                    f"can gain about {1 / max(statistics.median(busy), 1e-9):.2f}x at most here, plus what larger "
                    "decode batches save")
    plot([runs[s][-1] for s in args.schedules], Path(args.plot))
    summary = Path(args.out) / "pipeline_overlap.json"
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2, default=str))
    record.note(f"plot (each schedule's last run): {args.plot}; every run's figures: {summary}")
    record.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
