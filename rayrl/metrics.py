"""Metric names and loggers: JSONL, tensorboard, wandb, a reward-curve PNG, and an optional sink.

The Ray dashboard sink (``ray.util.metrics``) lives in actors/ because rayrl never imports ray; it is
passed in as ``extra_sink``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Callable

from rayrl.config import LoggingConfig

logger = logging.getLogger("rayrl")

# The per-step summary line: (metric key, label, format)
SUMMARY_FIELDS: list[tuple[str, str, str]] = [
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/success_rate", "success", "{:.2f}"),
    ("rollout/episodes_ok", "ok", "{:d}"),
    ("rollout/episodes_failed", "failed", "{:d}"),
    ("rollout/episodes_excluded", "excluded", "{:d}"),  # infrastructure failures: no reward, not trained
    ("train/trained_samples", "samples", "{:d}"),
    ("pipeline/dynamic_dropped_groups", "equal groups dropped", "{:d}"),  # with dynamic sampling
    ("pipeline/budget_stopped_draws", "groups the budget left undrawn", "{:d}"),  # pipeline.episode_budget ran out
    ("distill/reverse_kl", "reverse KL", "{:.3f}"),  # with a distillation teacher
    ("rollout/generated_tokens_per_s", "gen tok/s", "{:.1f}"),
    ("time/step_s", "step", "{:.1f}s"),
    ("train/policy_version", "version", "{:d}"),
]


def summary_line(step: int, total: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}/{total}"]
    for key, label, fmt in SUMMARY_FIELDS:
        if key in metrics:
            value = metrics[key]
            if "{:d}" in fmt:
                value = int(value)
            parts.append(f"{label} {fmt.format(value)}")
    return " | ".join(parts)


class CounterDeltas:
    """Per-step amounts from counters that only grow (an engine's cumulative forward seconds), and the
    wall time they cover. A counter that went down was reset (its engine restarted): all of its
    current value is new."""

    def __init__(self, now: float) -> None:
        self._last: dict[str, float] = {}
        self._last_at = now

    def update(self, totals: dict[str, float], now: float) -> tuple[dict[str, float], float]:
        """``(what each counter added since the last update, seconds since then)``."""
        deltas = {k: v - self._last.get(k, 0.0) if v >= self._last.get(k, 0.0) else v for k, v in totals.items()}
        window = now - self._last_at
        self._last, self._last_at = dict(totals), now
        return deltas, window


class MetricsLogger:
    """Writes each step's metrics to every configured destination."""

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        run_config: dict[str, Any] | None = None,
        extra_sink: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = run_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        if self.jsonl_path.exists():
            for line in self.jsonl_path.read_text().splitlines():
                if line.strip():
                    self.history.append(json.loads(line))
        self.extra_sink = extra_sink
        self._tb: Any = None  # made at the first log: importing its writer (torch) takes seconds a start need not wait
        self._wandb = None
        if cfg.wandb:
            import wandb

            self._wandb = wandb.init(
                project=cfg.wandb_project, name=run_dir.name, dir=str(run_dir), mode=cfg.wandb_mode, config=run_config
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        record = {"step": step, **clean}
        merged = {**next((h for h in self.history if h.get("step") == step), {}), **record}
        self.history = [h for h in self.history if h.get("step") != step] + [merged]
        with self.jsonl_path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.cfg.tensorboard and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self.extra_sink is not None:
            self.extra_sink(step, clean)
        if self.cfg.plot:
            self.plot_reward_curve()

    def plot_reward_curve(self, key: str = "rollout/reward_mean") -> Path | None:
        """Draw ``reward_curve.png`` from the history; None before the first step with ``key``."""
        fig = self.reward_figure(key)
        if fig is None:
            return None
        import matplotlib.pyplot as plt

        path = self.run_dir / "reward_curve.png"
        fig.savefig(path)
        plt.close(fig)
        return path

    def reward_figure(self, key: str = "rollout/reward_mean") -> Any:
        """The reward curve as a matplotlib figure (the caller closes it), or None without data."""
        points = [(h["step"], h[key]) for h in sorted(self.history, key=lambda h: h["step"]) if key in h]
        if not points:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        steps, values = zip(*points)
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
        ax.plot(steps, values, marker="o", linewidth=1.5, label="mean reward")
        if len(values) >= 3:
            window = 3
            smooth = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                      for i in range(len(values))]
            ax.plot(steps, smooth, linewidth=2.5, alpha=0.6, label=f"moving mean ({window})")
        evals = [(h["step"], h["eval/success_rate"]) for h in sorted(self.history, key=lambda h: h["step"])
                 if "eval/success_rate" in h]
        if evals:
            ax.plot(*zip(*evals), marker="s", linestyle="--", linewidth=1.5, label="held-out success")
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, even for a 2-step run
        ax.set_ylabel("reward")
        ax.set_title(self.run_dir.name)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
        fig.tight_layout()
        return fig

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def main() -> None:
    """``python -m rayrl.metrics runs/<exp_id>`` redraws that run's reward_curve.png from metrics.jsonl."""
    import sys

    run_dir = Path(sys.argv[1])
    logger_ = MetricsLogger(LoggingConfig(tensorboard=False), run_dir)
    print(logger_.plot_reward_curve())


if __name__ == "__main__":
    main()
