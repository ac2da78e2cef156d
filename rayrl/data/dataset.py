"""Task datasets read from the user's files as they are, and a sampler whose cursor is part of every
checkpoint.

A data file (JSONL, JSON, CSV, Parquet or a Hugging Face ``datasets`` directory: rayrl/data/formats.py)
holds one row per task. ``data.fields`` says which of the row's fields is what, in the file's own names:
the ``prompt`` (a string; ``data.max_prompt_chars`` filters on it), the ``id``, the ``metadata`` object
(the agent's payload verbatim), an ``answer`` copied into the metadata, and ``metadata_fields`` copied in
under their own names. The default mapping reads rayrl's own rows, ``{"prompt": ..., "metadata": {...},
"id": ...}``; a file with ``question``/``answer`` needs ``data.fields.prompt: question`` and
``data.fields.answer: answer``, not a rewrite. Every row is checked before any is used.

The sampler walks seeded permutations epoch after epoch; its state (epoch, position) restores exactly, so
a resumed run neither repeats nor skips a task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rayrl.data.formats import FormatError, invalid_reason, read_rows
from rayrl.types import Task

if TYPE_CHECKING:
    from rayrl.config import DataFields


class DatasetError(ValueError):
    """A malformed dataset file; the message names the file and the place of each bad row shown."""


MAX_REPORTED_ROWS = 5  # bad rows named in a DatasetError (the count covers all of them)
ALL_OTHER_FIELDS = "*"  # data.fields.metadata_fields: ["*"] copies every field not mapped otherwise


@dataclass(frozen=True)
class FieldMap:
    """Which field of a row is what (``data.fields``; the defaults read rayrl's own rows)."""

    prompt: str = "prompt"
    id: str = "id"
    metadata: str = "metadata"
    answer: str | None = None
    metadata_fields: tuple[str, ...] = ()

    @classmethod
    def of(cls, fields: "DataFields | None") -> "FieldMap":
        if fields is None:
            return cls()
        return cls(fields.prompt, fields.id, fields.metadata, fields.answer or None, tuple(fields.metadata_fields))

    def required(self) -> list[tuple[str, str]]:
        """``(field, config key)`` of every field each row must have."""
        need = [(self.prompt, "data.fields.prompt")]
        if self.answer:
            need.append((self.answer, "data.fields.answer"))
        need += [(name, "data.fields.metadata_fields") for name in self.metadata_fields if name != ALL_OTHER_FIELDS]
        return need

    def task(self, row: dict[str, Any], default_id: str) -> Task:
        """The Task of a row :meth:`problem` found nothing wrong with."""
        raw = row.get(self.metadata)
        metadata = dict(_object(raw) or {})
        if self.answer:
            metadata["answer"] = row[self.answer]
        names = self.metadata_fields
        if ALL_OTHER_FIELDS in names:
            mapped = {self.prompt, self.id, self.metadata, self.answer}
            names = tuple(k for k in row if k not in mapped)
        for name in names:
            metadata[name] = row[name]
        task_id = row.get(self.id)
        return Task(prompt=row[self.prompt], metadata=metadata,
                    task_id=str(task_id) if task_id not in (None, "") else default_id)

    def problem(self, row: Any) -> str | None:
        """What is wrong with one row, or None."""
        if not isinstance(row, dict):
            return f"a row must be an object, got {type(row).__name__}"
        for name, key in self.required():
            if name not in row:
                return f"no field {name!r} ({key}); the row has: {_names(row)}"
        if not isinstance(row[self.prompt], str):
            return f"{self.prompt!r} must be a string (data.fields.prompt), got {type(row[self.prompt]).__name__}"
        raw = row.get(self.metadata)
        if raw not in (None, "") and _object(raw) is None:
            return f"{self.metadata!r} must be an object (data.fields.metadata), got {type(raw).__name__}"
        return None


def _object(value: Any) -> dict[str, Any] | None:
    """``value`` as a metadata object: a dict, or text holding a JSON object (a CSV cell); else None."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return None
        return parsed if isinstance(parsed, dict) else None
    return None


def _names(row: dict[str, Any], limit: int = 12) -> str:
    names = [str(k) for k in row]
    return ", ".join(names[:limit]) + (f", ... ({len(names)} fields)" if len(names) > limit else "") or "(none)"


class FileDataset:
    """Tasks loaded from one data file, mapped by ``fields`` and filtered by prompt length.

    Every row is checked before any is used: a row that is not an object, lacks a field the mapping names,
    has a prompt that is not a string or a metadata that is not an object makes the whole file fail with
    ``place: what`` for the first :data:`MAX_REPORTED_ROWS` bad rows and the count of all of them, in one
    line; a field the mapping names that no row has is said once, with the fields the rows do have.
    """

    def __init__(self, path: str | Path, max_prompt_chars: int = 0, fields: "DataFields | None" = None,
                 format: str = "auto") -> None:
        self.path = Path(path)
        if not self.path.exists():
            where = "" if self.path.is_absolute() else f" (relative to {Path.cwd()})"
            raise DatasetError(f"data file not found: {self.path}{where}")
        self.fields = FieldMap.of(fields)
        self.tasks: list[Task] = []
        self.filtered = 0
        bad: list[str] = []
        missing = {name for name, _ in self.fields.required()}  # mapped fields no row had so far
        first: dict[str, Any] | None = None
        rows = 0
        try:
            for where, number, row in read_rows(self.path, format):
                rows += 1
                if isinstance(row, dict):
                    missing &= {name for name in missing if name not in row}
                    first = row if first is None else first
                problem = invalid_reason(row) or self.fields.problem(row)
                if problem:
                    bad.append(f"{where}: {problem}")
                    continue
                if max_prompt_chars and len(row[self.fields.prompt]) > max_prompt_chars:
                    self.filtered += 1
                    continue
                self.tasks.append(self.fields.task(row, f"{self.path.stem}-{number}"))
        except FormatError as err:
            raise DatasetError(str(err)) from None
        if missing and first is not None:
            name, key = next((name, key) for name, key in self.fields.required() if name in missing)
            hint = f"; map yours, e.g. {key}: <one of them>" if key == "data.fields.prompt" else ""
            raise DatasetError(f"{self.path}: no row has the field {name!r} ({key}); the rows have: "
                               f"{_names(first)}{hint}")
        if bad:
            more = f" ({len(bad)} bad rows in all)" if len(bad) > MAX_REPORTED_ROWS else ""
            raise DatasetError("; ".join(bad[:MAX_REPORTED_ROWS]) + more)
        if not self.tasks:
            raise DatasetError(f"{self.path}: no usable rows" + (" (it is empty)" if not rows else "")
                               + (f" ({self.filtered} longer than data.max_prompt_chars)" if self.filtered else ""))

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
