"""Datasets: the user's data files (JSONL, JSON, CSV, Parquet, a datasets directory) with their fields
mapped to tasks, and a resumable sampler."""

from rayrl.data.dataset import FileDataset, TaskSampler

__all__ = ["FileDataset", "TaskSampler"]
