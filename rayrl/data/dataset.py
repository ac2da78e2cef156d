"""JSONL task datasets and a sampler whose cursor is part of every checkpoint.

Each row is ``{"prompt": str, "metadata": {...}}`` (an optional ``"id"`` names the task). ``metadata``
is the agent payload verbatim; ``prompt`` drives length filtering. The sampler walks seeded
permutations epoch after epoch; its state (epoch, position) restores exactly, so a resumed run neither
repeats nor skips a task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rayrl.types import Task


class DatasetError(ValueError):
    """A malformed dataset file; the message names the file and the line of each bad row shown."""


MAX_REPORTED_ROWS = 5  # bad rows named in a DatasetError (the count covers all of them)


class JsonlDataset:
    """Tasks loaded from a JSONL file, filtered by prompt length.

    Every row is checked before any is used: a row that is not a JSON object, lacks a string ``prompt``,
    or has a ``metadata`` that is not an object makes the whole file fail with ``file:line: what`` for
    the first :data:`MAX_REPORTED_ROWS` bad rows and the count of all of them, in one line.
    """

    def __init__(self, path: str | Path, max_prompt_chars: int = 0) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            where = "" if self.path.is_absolute() else f" (relative to {Path.cwd()})"
            raise DatasetError(f"data file not found: {self.path}{where}")
        self.tasks: list[Task] = []
        self.filtered = 0
        bad: list[str] = []
        with self.path.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    bad.append(f"{self.path}:{lineno}: invalid JSON ({err.msg})")
                    continue
                problem = row_problem(row)
                if problem:
                    bad.append(f"{self.path}:{lineno}: {problem}")
                    continue
                task = self._task(row, lineno, max_prompt_chars)
                if task is not None:
                    self.tasks.append(task)
        if bad:
            more = f" ({len(bad)} bad rows in all)" if len(bad) > MAX_REPORTED_ROWS else ""
            raise DatasetError("; ".join(bad[:MAX_REPORTED_ROWS]) + more
                               + '; each row is {"prompt": str, "metadata": {...}, "id": optional}')
        if not self.tasks:
            raise DatasetError(f"{self.path}: no usable rows"
                               + (f" ({self.filtered} longer than data.max_prompt_chars)" if self.filtered else ""))

    def _task(self, row: dict[str, Any], lineno: int, max_prompt_chars: int) -> Task | None:
        if max_prompt_chars and len(row["prompt"]) > max_prompt_chars:
            self.filtered += 1
            return None
        metadata = row.get("metadata") if row.get("metadata") is not None else {}
        return Task(prompt=row["prompt"], metadata=metadata, task_id=str(row.get("id", f"{self.path.stem}-{lineno}")))

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]


class TaskSource(Protocol):
    """What a sampler walks: indexed tasks; optionally ``order(epoch, seed, shuffle)``, its own draw order."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Task: ...


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0


class TaskSampler:
    """Seeded epoch-wise shuffling with an exact, serialisable cursor."""

    def __init__(self, dataset: TaskSource, seed: int = 0, shuffle: bool = True) -> None:
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.state = SamplerState()
        self._cached: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        order = getattr(self.dataset, "order", None)
        if order is not None:  # a dataset with its own draw order (a weighted mixture: rayrl/data/reasoning_gym.py)
            if self._cached is None or self._cached[0] != epoch:
                self._cached = (epoch, order(epoch, self.seed, self.shuffle))
            return self._cached[1]
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next(self, count: int) -> list[Task]:
        out: list[Task] = []
        while len(out) < count:
            order = self._order(self.state.epoch)
            take = min(count - len(out), len(order) - self.state.position)
            out.extend(self.dataset[int(i)] for i in order[self.state.position : self.state.position + take])
            self.state.position += take
            if self.state.position >= len(order):
                self.state = SamplerState(self.state.epoch + 1, 0)
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.state.epoch, "position": self.state.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = SamplerState(int(state["epoch"]), int(state["position"]))


def row_problem(row: Any) -> str | None:
    """What is wrong with one parsed JSONL row, or None."""
    if not isinstance(row, dict):
        return f"a row must be a JSON object, got {type(row).__name__}"
    if not isinstance(row.get("prompt"), str):
        got = "" if "prompt" not in row else f", got {type(row['prompt']).__name__}"
        return "each row needs a string 'prompt'" + got
    if row.get("metadata") is not None and not isinstance(row["metadata"], dict):
        return f"'metadata' must be an object, got {type(row['metadata']).__name__}"
    return None
