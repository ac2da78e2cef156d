"""reasoning-gym's procedural datasets as rayrl tasks, and their own ``score_answer`` as the reward.

``data.reasoning_gym`` names one or more datasets (rayrl/config/data_sources.py). Each is generated with
its own seed, so nothing is downloaded; a held-out set is the same generator under another seed, with any
question that also appears among the training tasks dropped (small generators repeat themselves). A task
carries what scoring needs in ``metadata.reasoning_gym`` (the dataset's name, its options and the whole
entry), so the reward runs in any rollout worker without the run's config.

Weights: every epoch draws each task once in a seeded order; a dataset's weight sets its share of the
draws. When the shares differ from the sizes, a dataset whose share is larger than its size repeats
tasks within an epoch and one whose share is smaller leaves some for later epochs (each dataset walks
its own seeded permutation across epochs), so the mixture holds at every point of the run.

reasoning-gym is an optional dependency (``pip install 'rayrl[reasoning-gym]'``); a missing package, an
unknown name or options its config class rejects are ConfigErrors naming the field (:func:`check_sources`).
"""

from __future__ import annotations

import json
import logging
import re
import time
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np

from rayrl.config import ConfigError, ReasoningGymSource
from rayrl.extensions import did_you_mean
from rayrl.types import Task

logger = logging.getLogger("rayrl.data")

FIELD = "data.reasoning_gym"
INSTALL = "pip install 'rayrl[reasoning-gym]'"


def _registry() -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as err:
        raise ConfigError(f"{FIELD}: needs the reasoning-gym package ({err}); {INSTALL}") from None
    return DATASETS


def _make(source: ReasoningGymSource, where: str, size: int, seed: int) -> Any:
    """The reasoning-gym dataset object; a ConfigError naming ``where`` for a bad name or option."""
    registry = _registry()
    if source.name not in registry:
        hint = did_you_mean(source.name, list(registry))
        raise ConfigError(f"{where}.name: no reasoning-gym dataset {source.name!r}{hint} ({len(registry)} "
                          "exist: python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')")
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(source.name, **dict(source.config), size=size, seed=seed)
    except TypeError as err:  # an option its config class does not have
        raise ConfigError(f"{where}.config: {source.name} rejects these options: {err}") from None
    except (AssertionError, ValueError) as err:  # its config's validate()
        raise ConfigError(f"{where}.config: {source.name} rejects these options: {err or 'invalid'}") from None


def check_sources(sources: Sequence[ReasoningGymSource]) -> None:
    """Before Ray starts: the package is there, each name exists and each config builds and makes a task."""
    for i, source in enumerate(sources):
        where = f"{FIELD}[{i}]"
        dataset = _make(source, where, size=1, seed=source.seed)
        try:
            dataset[0]
        except Exception as err:
            raise ConfigError(f"{where}: {source.name} failed to generate a task: "
                              f"{type(err).__name__}: {err}") from None


def _task(source: ReasoningGymSource, entry: dict[str, Any], split: str, index: int) -> Task:
    payload = {"dataset": source.name, "config": dict(source.config), "entry": entry}
    seed = source.seed if split == "train" else source.held_out_seed()
    return Task(prompt=str(entry["question"]), metadata={"reasoning_gym": payload},
                task_id=f"rg-{source.name}-{split}{seed}-{index}")


class ReasoningGymTasks:
    """The generated tasks of several datasets, with the weighted draw order :class:`TaskSampler` walks."""

    def __init__(self, sources: Sequence[ReasoningGymSource], split: str = "train",
                 exclude: set[str] | None = None) -> None:
        self.sources = list(sources)
        self.tasks: list[Task] = []
        self.spans: list[tuple[int, int]] = []  # (first index, count) per source
        self.dropped = 0  # held-out questions equal to a training question
        for i, source in enumerate(self.sources):
            held_out = split != "train"
            size = source.val_size if held_out else source.size
            start = len(self.tasks)
            if size:
                t0 = time.monotonic()
                seed = source.held_out_seed() if held_out else source.seed
                dataset = _make(source, f"{FIELD}[{i}]", size=size, seed=seed)
                for j in range(size):
                    entry = dataset[j]
                    if exclude is not None and entry["question"] in exclude:
                        self.dropped += 1
                        continue
                    self.tasks.append(_task(source, entry, split, j))
                logger.info("reasoning-gym %s: %d %s tasks (seed %d) in %.1f s", source.name, len(self.tasks) - start,
                            split, seed, time.monotonic() - t0)
            self.spans.append((start, len(self.tasks) - start))
        total = sum(count for _, count in self.spans)
        self.weights = np.array([(s.weight if s.weight is not None else count / max(total, 1)) if count else 0.0
                                 for s, (_, count) in zip(self.sources, self.spans)], dtype=np.float64)
        if self.weights.sum() > 0:
            self.weights = self.weights / self.weights.sum()

    def questions(self) -> set[str]:
        return {t.prompt for t in self.tasks}

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    def order(self, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """The indices drawn in ``epoch``: ``len(self)`` draws, each from a dataset picked by weight, taking
        that dataset's next task along its own permutation (which carries over from epoch to epoch).
        Deterministic in (seed, epoch), so the sampler's (epoch, position) cursor restores it exactly."""
        n = len(self.tasks)
        live = [k for k, (_, count) in enumerate(self.spans) if count]
        if len(live) == 1 or n == 0:
            start, count = self.spans[live[0]] if live else (0, 0)
            perm = np.random.default_rng([seed, epoch]).permutation(count) if shuffle else np.arange(count)
            return start + perm
        picks = self._picks(seed, epoch, n, shuffle)
        out = np.empty(n, dtype=np.int64)
        for k in live:
            start, count = self.spans[k]
            where = np.flatnonzero(picks == k)
            steps = epoch * len(where) + np.arange(len(where))  # its draws so far (the same count every epoch)
            laps, pos = np.divmod(steps, count)
            for lap in np.unique(laps):
                perm = (np.random.default_rng([seed, k, int(lap)]).permutation(count) if shuffle
                        else np.arange(count))
                sel = laps == lap
                out[where[sel]] = start + perm[pos[sel]]
        return out

    def _picks(self, seed: int, epoch: int, n: int, shuffle: bool) -> np.ndarray:
        """Which dataset each draw of ``epoch`` comes from: exactly each dataset's share, rounded (largest
        remainders), in a seeded order (in dataset order without shuffle)."""
        quota = self.weights * n
        counts = np.floor(quota).astype(np.int64)
        rest = n - int(counts.sum())
        if rest:
            counts[np.argsort(-(quota - counts), kind="stable")[:rest]] += 1
        picks = np.repeat(np.arange(len(counts)), counts)
        return np.random.default_rng([seed, epoch, 7]).permutation(picks) if shuffle else picks


def load_splits(sources: Sequence[ReasoningGymSource]) -> tuple[ReasoningGymTasks, ReasoningGymTasks | None]:
    """The training tasks, and the held-out tasks when any entry has ``val_size`` (None otherwise)."""
    train = ReasoningGymTasks(sources, "train")
    if not any(s.val_size for s in sources):
        return train, None
    val = ReasoningGymTasks(sources, "val", exclude=train.questions())
    if val.dropped:
        logger.info("reasoning-gym: %d held-out questions also drawn for training were dropped", val.dropped)
    if not len(val):
        raise ConfigError(f"{FIELD}: every held-out question is also a training question; raise the datasets' "
                          "difficulty or lower size")
    return train, val


_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def extract_answer(text: str | None) -> str:
    """``reasoning_gym_lenient``'s reading: the text inside the last ``<answer>...</answer>`` (any case), or
    the whole reply stripped when it has no such tags."""
    if not text:
        return ""
    found = _TAG.findall(text)
    return (found[-1] if found else text).strip()


def strict_answer(text: str | None) -> str | None:
    """``reasoning_gym``'s reading, reasoning-gym's own (``reasoning_gym.utils.extract_answer``, as its GRPO
    trainer scores): the last ``<answer>...</answer>``, case-sensitive; None without tags, which its
    ``score_answer`` scores 0."""
    from reasoning_gym.utils import extract_answer as their_extract

    return their_extract(text, tag_name="answer") if text else None


@lru_cache(maxsize=256)
def _scorer(name: str, config_json: str) -> Any:
    """The dataset object whose ``score_answer`` grades ``name``'s entries (some read their config)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **json.loads(config_json), size=1, seed=0)


def _score(task: Task, result: Any, answer_of: Callable[[str | None], str | None]) -> float:
    payload = task.metadata.get("reasoning_gym") if isinstance(task.metadata, dict) else None
    if not isinstance(payload, dict) or "entry" not in payload:
        raise ValueError(f"task {task.task_id} is not a reasoning-gym task (no metadata.reasoning_gym); "
                         "rollout.reward: reasoning_gym scores data.reasoning_gym's tasks")
    if getattr(result, "status", "completed") == "error":
        return 0.0
    scorer = _scorer(payload["dataset"], json.dumps(payload.get("config") or {}, sort_keys=True))
    return float(scorer.score_answer(answer_of(getattr(result, "final_answer", None)), payload["entry"]))


def reasoning_gym_reward(task: Task, result: Any) -> float:
    """``rollout.reward: reasoning_gym``: the dataset's own ``score_answer`` on the answer as reasoning-gym
    reads it (:func:`strict_answer`: a reply without ``<answer>`` tags scores 0). 0.0 for an agent that failed."""
    return _score(task, result, strict_answer)


def reasoning_gym_lenient_reward(task: Task, result: Any) -> float:
    """``rollout.reward: reasoning_gym_lenient``: the same score on :func:`extract_answer`'s reading (a reply
    without tags is scored whole, so a sentence that contains the answer earns partial credit)."""
    return _score(task, result, extract_answer)
