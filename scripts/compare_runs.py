"""Several finished runs side by side: their per-step table and their reward curves in one PNG.

Reads only each run's own ``metrics.jsonl`` (what the driver wrote), so a figure in docs/ can be redrawn
from the runs that made it. Used for docs/lora.md (full weights against LoRA on the calculator task) and
docs/results/reasoning_gym.md.

    python scripts/compare_runs.py --out docs/results/lora_calculator.png full=runs/a lora=runs/b
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

COLUMNS = (("reward", "rollout/reward_mean", "{:.3f}"), ("samples", "train/trained_samples", "{:.0f}"),
           ("step s", "time/step_s", "{:.1f}"),
           ("train s", "time/train_s", "{:.1f}"), ("update s", "time/weight_sync_s", "{:.2f}"))


def load(run_dir: Path) -> list[dict]:
    """The run's step records, in step order (one line per step; a resumed run's repeated step: the last)."""
    rows: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows.setdefault(record["step"], {}).update(record)
    return [rows[s] for s in sorted(rows)]


def cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return fmt.format(value) if isinstance(value, (int, float)) and not math.isnan(value) else "-"


def table(runs: dict[str, list[dict]]) -> str:
    """Markdown: one row per step, the runs' columns side by side, then each column's mean over steps."""
    head = ["step"] + [f"{name} {col}" for name in runs for col, _, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    steps = sorted({r["step"] for rows in runs.values() for r in rows})
    by_step = {name: {r["step"]: r for r in rows} for name, rows in runs.items()}
    for step in steps:
        cells = [str(step)] + [cell(by_step[name].get(step, {}), key, fmt)
                               for name in runs for _, key, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    means = ["mean"]
    for rows in runs.values():
        for _, key, fmt in COLUMNS:
            values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            means.append(fmt.format(sum(values) / len(values)) if values else "-")
    lines.append("| " + " | ".join(means) + " |")
    lines.append("")
    for name, rows in runs.items():  # trained samples differ per step (groups of one reward train nothing)
        trained = [r for r in rows if r.get("train/trained_samples")]
        samples = sum(r["train/trained_samples"] for r in trained)
        if samples:
            lines.append(f"{name}: {sum(r['time/train_s'] for r in trained) / samples:.2f} s of train step per trained "
                         f"sample ({samples:.0f} samples in {len(trained)} steps that trained); "
                         f"{sum(r.get('time/step_s', 0.0) for r in rows):.0f} s of steps in all")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=110)
    for k, (name, rows) in enumerate(runs.items()):
        points = [(r["step"], r["rollout/reward_mean"]) for r in rows if "rollout/reward_mean" in r]
        ax.plot(*zip(*points), marker="o", linewidth=1.5, color=f"C{k}", label=f"{name}: train reward")
        evals = [(r["step"], r["eval/success_rate"]) for r in rows if "eval/success_rate" in r]
        if evals:
            ax.plot(*zip(*evals), marker="s", linestyle="--", color=f"C{k}", label=f"{name}: held-out success")
        eval_rewards = [(r["step"], r["eval/reward_mean"]) for r in rows if "eval/reward_mean" in r]
        if eval_rewards and any(v != s for (_, v), (_, s) in zip(eval_rewards, evals)):  # partial credit: apart
            ax.plot(*zip(*eval_rewards), marker="^", linestyle=":", color=f"C{k}", label=f"{name}: held-out reward")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("mean reward / success")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="NAME=RUN_DIR, in the order to show them")
    ap.add_argument("--out", type=Path, help="the PNG to write (none: the table only)")
    ap.add_argument("--title", default="reward per step")
    args = ap.parse_args()
    runs = {}
    for spec in args.runs:
        name, _, path = spec.partition("=")
        if not path:
            ap.error(f"{spec!r}: expected NAME=RUN_DIR")
        runs[name] = load(Path(path))
    print(table(runs))
    if args.out:
        plot(runs, args.out, args.title)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
