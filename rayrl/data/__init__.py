"""Datasets: JSONL rows ``{"prompt": ..., "metadata": {...}}`` and a resumable sampler."""

from rayrl.data.dataset import JsonlDataset, TaskSampler

__all__ = ["JsonlDataset", "TaskSampler"]
