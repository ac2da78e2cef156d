"""The metric loggers users watch: tensorboard event files and wandb (offline mode, no account needed)."""

from __future__ import annotations

import json
import time

from rayrl.config import LoggingConfig
from rayrl.metrics import CounterDeltas, MetricsLogger
from tests.ops.wandb_log import history_rows


def test_tensorboard_and_wandb_offline_receive_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = LoggingConfig(tensorboard=True, wandb=True, wandb_mode="offline", wandb_project="rayrl-test", plot=False)
    sink: list[tuple[int, dict]] = []
    logger = MetricsLogger(cfg, tmp_path / "exp", run_config={"seed": 7},
                           extra_sink=lambda step, m: sink.append((step, m)))
    for step in (1, 2, 3):
        logger.log(step, {"rollout/reward_mean": step / 10, "train/loss": 1.0 / step, "note": "not a number"})
    logger.close()

    runs = list((tmp_path / "exp" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # the offline history that `wandb sync` uploads later holds every step
    # (wandb's writer process may still be flushing the file right after finish(): poll briefly)
    deadline = time.monotonic() + 30
    while len(rows := history_rows(next(runs[0].glob("run-*.wandb")))) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [(r["_step"], r["rollout/reward_mean"], r["train/loss"]) for r in rows] == [
        (1, 0.1, 1.0), (2, 0.2, 0.5), (3, 0.3, 1.0 / 3)]
    assert all("note" not in r for r in rows)  # non-numeric values never reach a logger

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "exp" / "tensorboard"))
    events.Reload()
    rewards = [(e.step, round(e.value, 6)) for e in events.Scalars("rollout/reward_mean")]
    assert rewards == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [s for s, _ in sink] == [1, 2, 3]
    lines = (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_counter_deltas_per_step_and_after_a_reset():
    deltas = CounterDeltas(now=100.0)
    assert deltas.update({"decode_s": 3.0, "prefill_s": 1.0}, now=110.0) == ({"decode_s": 3.0, "prefill_s": 1.0}, 10.0)
    assert deltas.update({"decode_s": 5.5, "prefill_s": 1.0}, now=115.0) == ({"decode_s": 2.5, "prefill_s": 0.0}, 5.0)
    # the engine restarted: its counters began again from zero
    assert deltas.update({"decode_s": 0.5, "prefill_s": 2.0}, now=117.0) == ({"decode_s": 0.5, "prefill_s": 1.0}, 2.0)


def test_the_reward_curve_has_whole_steps_on_its_x_axis(tmp_path):
    logger = MetricsLogger(LoggingConfig(tensorboard=False, plot=True), tmp_path)
    for step, reward in ((1, 0.25), (2, 0.5)):  # two points: matplotlib alone would tick 1.0, 1.2, ... 2.0
        logger.log(step, {"rollout/reward_mean": reward})
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    fig = logger.reward_figure()
    ax = fig.axes[0]
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    import matplotlib.pyplot as plt

    plt.close(fig)
    logger.close()
