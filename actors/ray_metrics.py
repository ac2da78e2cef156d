"""Step metrics as Ray metrics (``ray.util.metrics``): exported on each node's metrics port in
Prometheus format, shown in the Ray dashboard's Metrics view once Prometheus and Grafana are set up."""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Gauge, Histogram

STALENESS_BUCKETS = [0.5, 1.5, 2.5, 3.5, 4.5, 8.5]  # policy versions behind; bucket edges between integers


class RayMetricsSink:
    """Step metrics as Ray gauges, visible in the Ray dashboard's Metrics view."""

    def __init__(self, exp_id: str) -> None:
        self._gauge = Gauge("rayrl_step_metric", "rayrl per-step metrics", tag_keys=("exp_id", "metric"))
        self.exp_id = exp_id
        self._staleness = Histogram("rayrl_sample_staleness", "policy versions between a sample's oldest token "
                                    "and the weights it trains", boundaries=STALENESS_BUCKETS, tag_keys=("exp_id",))

    def __call__(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            self._gauge.set(float(value), tags={"exp_id": self.exp_id, "metric": key})

    def staleness(self, values: list[int]) -> None:
        for v in values:
            self._staleness.observe(float(v), tags={"exp_id": self.exp_id})
