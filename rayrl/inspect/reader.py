"""Reads a run directory for the inspector, forgiving what a live or damaged run leaves behind.

What it reads (all written by a normal run, rayrl/records.py and rayrl/metrics.py): ``config.yaml``,
``metrics.jsonl``, ``episodes/stepNNNNNN.jsonl``, ``inspect/stepNNNNNN.json`` and ``guards.jsonl`` (the
guards that fired, rayrl/rl/guards.py: each is given the ``key`` of its example episode, so the page links
to it). Why forgiving: the
inspector is used on runs that are still going (the last line of a JSONL file may be half written, a
step may have episodes but no metrics yet) and on runs that crashed or were copied in part. Each such
defect becomes one readable line in ``problems`` and the rest is shown; only a path that is not a run
directory at all raises :class:`RunDirError`, whose message says what was expected.

Every episode is named by ``key`` = ``"<step>:<index in that step>"`` (a failed episode may have no
session id). Files are re-read only when their modification time or size changed, so a browser that
polls a live run costs one ``stat`` per file; :meth:`RunReader.stamp` names the directory's state from
those stats alone, so the server can answer "nothing changed" without reading or sending the run again.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rayrl.rl.guards import GUARDS_FILE

_STEP_FILE = re.compile(r"^step(\d+)\.(jsonl|json)$")


class RunDirError(Exception):
    """The path is not a readable run directory (the message says why and what was expected)."""


@dataclass
class Run:
    """One read of a run directory: what the page lists, with the problems met on the way."""

    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    episodes: list[dict[str, Any]]
    detail_steps: list[int]
    problems: list[str] = field(default_factory=list)
    stamp: str = ""  # RunReader.stamp() taken before the files were read
    guards: list[dict[str, Any]] = field(default_factory=list)  # guards.jsonl, each with its example's "key"

    def summary(self) -> dict[str, Any]:
        """The JSON the page starts from."""
        model = self.config.get("model") if isinstance(self.config.get("model"), dict) else {}
        rollout = self.config.get("rollout") if isinstance(self.config.get("rollout"), dict) else {}
        return {"path": str(self.path), "exp_id": self.config.get("exp_id", self.path.name),
                "model": model.get("path", ""), "harness": rollout.get("agent", ""),
                "steps": sorted({e["step"] for e in self.episodes}), "detail_steps": self.detail_steps,
                "metrics": self.metrics, "episodes": self.episodes, "problems": self.problems,
                "guards": self.guards, "stamp": self.stamp}


class _Cache:
    """Parsed files by path, valid while (mtime, size) is unchanged."""

    def __init__(self) -> None:
        self._entries: dict[Path, tuple[tuple[float, int], Any]] = {}

    def get(self, path: Path, parse: Any, fallback: Any, problems: list[str]) -> Any:
        """``parse(path)``, or ``fallback`` with a problem noted when the file cannot be read (it vanished,
        no permission): a live run replaces files under us."""
        try:
            st = path.stat()
            stamp = (st.st_mtime, st.st_size)
            hit = self._entries.get(path)
            if hit is not None and hit[0] == stamp:
                return hit[1]
            value = parse(path)
        except OSError as err:
            problems.append(f"{path.parent.name}/{path.name} could not be read: {err.strerror or err}")
            return fallback
        self._entries[path] = (stamp, value)
        return value


def _jsonl(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    rows, problems = [], []
    lines = path.read_text(errors="replace").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            where = "last line (still being written?)" if n == len(lines) else f"line {n}"
            problems.append(f"{path.parent.name}/{path.name}: {where} is not valid JSON; skipped")
            continue
        if not isinstance(row, dict):
            problems.append(f"{path.parent.name}/{path.name}: line {n} is not a JSON object; skipped")
            continue
        rows.append(row)
    return rows, problems


def _json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        doc = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError as err:
        name = f"{path.parent.name}/{path.name}"
        return None, f"{name} is not valid JSON ({err.msg} at line {err.lineno}); its detail is not shown"
    if not isinstance(doc, dict) or not isinstance(doc.get("episodes"), list):
        return None, f"{path.parent.name}/{path.name} is not an inspection file (no 'episodes' list); no detail shown"
    return doc, None


def _step_files(directory: Path, suffix: str) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _STEP_FILE.match(p.name)
        if m and m.group(2) == suffix:
            found.append((int(m.group(1)), p))
    return sorted(found)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _runs_length(value: Any) -> int | None:
    """The length a ``[[value, count], ...]`` list spells out, or None when it is not one."""
    if not isinstance(value, list) or not all(_ints(r) and len(r) == 2 and r[1] >= 0 for r in value):
        return None
    return sum(r[1] for r in value)


def _tree_problem(tree: Any) -> str | None:
    """What makes a tree description unusable (rayrl/trajectory/describe.py), or None (None is no tree)."""
    if tree is None:
        return None
    nodes = tree.get("nodes") if isinstance(tree, dict) else None
    if not isinstance(nodes, list):
        return "the turn tree has no 'nodes' list"
    for i, n in enumerate(nodes):
        if not isinstance(n, dict) or n.get("id") != i or not isinstance(n.get("role"), str):
            return f"turn tree node {i} is malformed (needs id {i} and a role)"
        parent = n.get("parent")
        if parent is not None and not (isinstance(parent, int) and 0 <= parent < i):
            return f"turn tree node {i} names parent {parent!r}, which does not come before it"
        gen = n.get("gen")
        if gen is not None and not (isinstance(gen, dict)
                                    and _ints([gen.get(k) for k in ("turn", "prompt_len", "response_len")])):
            return f"turn tree node {i}'s LLM call is malformed"
    return None


def _samples_problem(samples: Any) -> str | None:
    """What makes a list of sample details unusable (rayrl/records.py ``sample_detail``), or None."""
    if samples is None:
        return None
    if not isinstance(samples, list):
        return "'samples' is not a list"
    for k, sample in enumerate(samples):
        if not isinstance(sample, dict) or not _ints(sample.get("tokens")) or not _ints(sample.get("turns", [])):
            return f"sample {k} is malformed (needs token ids)"
        prompt, tokens = sample.get("prompt_length"), sample["tokens"]
        if not isinstance(prompt, int) or not 0 <= prompt <= len(tokens):
            return f"sample {k}'s prompt_length is not within its {len(tokens)} tokens"
        response = len(tokens) - prompt
        logprobs = sample.get("logprobs")
        if _runs_length(sample.get("mask")) != response or _runs_length(sample.get("versions")) != response:
            return f"sample {k}'s mask or versions do not cover its {response} response tokens"
        if not isinstance(logprobs, list) or len(logprobs) != response:
            return f"sample {k}'s logprobs do not cover its {response} response tokens"
    return None


def _stat_part(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return f"{path.name} -"
    return f"{path.parent.name}/{path.name} {st.st_size} {st.st_mtime_ns}"


class RunReader:
    """Reads one run directory (see module docstring); cheap to call again on a live run."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise RunDirError(f"{self.path}: no such directory")
        if not self.path.is_dir():
            raise RunDirError(f"{self.path} is a file, not a run directory (expected runs/<exp_id>/)")
        markers = ("config.yaml", "metrics.jsonl", "episodes")
        if not any((self.path / m).exists() for m in markers):
            raise RunDirError(f"{self.path} does not look like a rayrl run directory: it has none of "
                              f"{', '.join(markers)} (expected runs/<exp_id>/ as a training run writes it)")
        self._cache = _Cache()

    def _config(self, problems: list[str]) -> dict[str, Any]:
        path = self.path / "config.yaml"
        if not path.exists():
            problems.append("config.yaml is missing (the run may still be starting)")
            return {}
        try:
            config = self._cache.get(path, lambda p: yaml.safe_load(p.read_text(errors="replace")), {}, problems)
        except yaml.YAMLError as err:
            problems.append(f"config.yaml is not valid YAML: {str(err).splitlines()[0]}")
            return {}
        if not isinstance(config, dict):
            problems.append("config.yaml does not hold a mapping")
            return {}
        return config

    def stamp(self) -> str:
        """A short name for the state of every file the inspector reads (paths, sizes, modification times):
        equal stamps, equal reads. Taken before a read, so a file that changes during it changes the next."""
        parts = []
        for path in (self.path / "config.yaml", self.path / "metrics.jsonl", self.path / GUARDS_FILE):
            parts.append(_stat_part(path))
        for _, path in _step_files(self.path / "episodes", "jsonl") + _step_files(self.path / "inspect", "json"):
            parts.append(_stat_part(path))
        return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]

    def read(self) -> Run:
        """The run as it is on disk now."""
        stamp = self.stamp()
        problems: list[str] = []
        config = self._config(problems)
        metrics: list[dict[str, Any]] = []
        metrics_path = self.path / "metrics.jsonl"
        if metrics_path.exists():
            rows, bad = self._cache.get(metrics_path, _jsonl, ([], []), problems)
            metrics = [r for r in rows if isinstance(r.get("step"), int)]
            problems += bad
        else:
            problems.append("metrics.jsonl is missing (no step has finished yet?)")
        episodes: list[dict[str, Any]] = []
        for step, path in _step_files(self.path / "episodes", "jsonl"):
            rows, bad = self._cache.get(path, _jsonl, ([], []), problems)
            problems += bad
            for index, row in enumerate(rows):
                episodes.append({**row, "step": step, "index": index, "key": f"{step}:{index}"})
        detail_steps = [step for step, _ in _step_files(self.path / "inspect", "json")]
        return Run(self.path, config, metrics, episodes, detail_steps, problems, stamp,
                   self._guards(episodes, problems))

    def _guards(self, episodes: list[dict[str, Any]], problems: list[str]) -> list[dict[str, Any]]:
        """The guards that fired, oldest first, each with the ``key`` of its example episode (None when
        that episode is not in the run's files)."""
        path = self.path / GUARDS_FILE
        if not path.exists():
            return []
        rows, bad = self._cache.get(path, _jsonl, ([], []), problems)
        problems += bad
        keys = {e["key"] for e in episodes}
        return [{**r, "key": key if (key := f"{r.get('step')}:{r.get('index')}") in keys else None} for r in rows]

    def episode(self, step: int, index: int) -> dict[str, Any] | None:
        """One episode's summary row, tree, samples and the vocabulary its tokens need; None if unknown.

        ``problem`` says why the tree or samples are missing when they are."""
        path = self.path / "episodes" / f"step{step:06d}.jsonl"
        if not path.exists():
            return None
        problems: list[str] = []
        rows, _ = self._cache.get(path, _jsonl, ([], []), problems)
        if not 0 <= index < len(rows):
            return None
        out: dict[str, Any] = {"row": {**rows[index], "step": step, "index": index, "key": f"{step}:{index}"},
                               "tree": None, "samples": None, "vocab": {}, "problem": None}
        inspect_path = self.path / "inspect" / f"step{step:06d}.json"
        if not inspect_path.exists():
            out["problem"] = "no inspection data for this step (logging.inspect_episodes_per_step was 0?)"
            return out
        doc, problem = self._cache.get(inspect_path, _json, (None, None), problems)
        if doc is None:
            out["problem"] = problem or "; ".join(problems)
            return out
        entry = next((e for e in doc["episodes"] if isinstance(e, dict) and e.get("index") == index), None)
        if entry is None:
            out["problem"] = f"inspect/{inspect_path.name} has no entry for episode {index}"
            return out
        out["tree"], out["samples"] = entry.get("tree"), entry.get("samples")
        where = f"inspect/{inspect_path.name}, episode {index}"
        bad = [f"{where}: {what}; not shown" for what in (_tree_problem(out["tree"]), _samples_problem(out["samples"]))
               if what is not None]
        if bad:
            out["tree"] = None if _tree_problem(out["tree"]) else out["tree"]
            out["samples"] = None if _samples_problem(out["samples"]) else out["samples"]
            out["problem"] = "; ".join(bad)
        vocab = doc.get("vocab") if isinstance(doc.get("vocab"), dict) else {}
        ids = {str(t) for s in out["samples"] or [] for t in s.get("tokens", [])}
        out["vocab"] = {t: vocab[t] for t in ids if t in vocab}
        return out
