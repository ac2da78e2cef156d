"""The data file formats a run reads its tasks from, one table: what each is, how it is recognised, how its
rows are read.

Every reader yields ``(where, number, row)``: ``where`` names the row for an error message (``file:line``
for line formats, ``file[i]`` for the others), ``number`` is its line (line formats) or its index, which a
row without an id is named by, and ``row`` is whatever the file holds there, a dict when the file is well
formed (rayrl/data/dataset.py checks it and maps its fields). A file that cannot be read at all (a
JSON document that does not parse, a missing optional package) raises :class:`FormatError` with one line
saying what to do. ``data.format: auto`` picks the format from the path: a directory is a Hugging Face
``datasets`` directory (``save_to_disk``), a file goes by its suffix.

Optional packages, imported only when their format is read: pyarrow (Parquet) and datasets (a
``save_to_disk`` directory); ``pip install 'rayrl[data]'`` installs both. Sources that are generated rather
than read (reasoning-gym) are not formats; they live beside this module.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

Rows = Iterator[tuple[str, int, Any]]


class FormatError(ValueError):
    """A data file that cannot be read as its format; the message is one line naming the file."""


def _jsonl(path: Path) -> Rows:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", lineno, json.loads(line)
            except json.JSONDecodeError as err:
                yield f"{path}:{lineno}", lineno, _Invalid(f"invalid JSON ({err.msg})")


def _json(path: Path) -> Rows:
    """A JSON array of rows, or an object with exactly one array (``{"data": [...]}``); a file of one JSON
    object per line (what ``datasets``' ``to_json`` writes under a ``.json`` name) reads as JSON Lines."""
    text = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" and text.lstrip().startswith("{"):
            yield from _jsonl(path)
            return
        raise FormatError(f"{path}: invalid JSON at line {err.lineno} ({err.msg})") from None
    if isinstance(doc, dict):
        arrays = [key for key, value in doc.items() if isinstance(value, list)]
        if len(arrays) != 1:
            raise FormatError(f"{path}: a JSON data file is an array of rows or an object holding one array "
                              f"(got an object with {len(arrays)} arrays)")
        doc = doc[arrays[0]]
    if not isinstance(doc, list):
        raise FormatError(f"{path}: a JSON data file is an array of rows, got {type(doc).__name__}")
    for i, row in enumerate(doc):
        yield f"{path}[{i}]", i, row


def _csv(path: Path) -> Rows:
    """A header line, then one row per line; ``.tsv`` is tab-separated. Every value is text (a metadata
    field holding a JSON object is parsed by the field mapping)."""
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
        if not reader.fieldnames:
            raise FormatError(f"{path}: no header line (a CSV data file starts with its field names)")
        twice = sorted({name for name in reader.fieldnames if reader.fieldnames.count(name) > 1})
        if twice:
            raise FormatError(f"{path}: the header names {', '.join(map(repr, twice))} more than once")
        header = len(reader.fieldnames)
        for row in reader:
            cells = _cells_in(row)
            if cells != header:  # a cell more or less than the header: the fields would not line up
                yield f"{path}:{reader.line_num}", reader.line_num, _Invalid(
                    f"{cells} cells, the header has {header} fields")
                continue
            yield f"{path}:{reader.line_num}", reader.line_num, row


def _cells_in(row: dict[Any, Any]) -> int:
    """The cells a csv.DictReader row held: its fields' values that are not the filler None, and the extra
    ones it keeps under the key None."""
    return sum(1 for k, v in row.items() if k is not None and v is not None) + len(row.get(None) or ())


def _parquet(path: Path) -> Rows:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise FormatError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow (or 'rayrl[data]')") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow's errors have no common base worth naming
        raise FormatError(f"{path}: not a readable Parquet file: {type(err).__name__}: {err}") from None
    for i, row in enumerate(rows):
        yield f"{path}[{i}]", i, row


def _hf_disk(path: Path) -> Rows:
    try:
        import datasets
    except ImportError:
        raise FormatError(f"{path}: a Hugging Face datasets directory needs the datasets package: "
                          "pip install 'datasets<5' (or 'rayrl[data]')") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:
        raise FormatError(f"{path}: not a datasets save_to_disk directory: {type(err).__name__}: {err}") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(loaded)
        first = next(iter(loaded), "train")
        raise FormatError(f"{path}: holds the splits {splits}; point the path at one split's directory "
                          f"({path / first})")
    for i, row in enumerate(loaded):
        yield f"{path}[{i}]", i, row


class _Invalid:
    """A row that could not be parsed; the dataset reports ``what`` at its ``where``."""

    def __init__(self, what: str) -> None:
        self.what = what


def invalid_reason(row: Any) -> str | None:
    """Why the reader could not parse this row, or None for a parsed one."""
    return row.what if isinstance(row, _Invalid) else None


@dataclass(frozen=True)
class FileFormat:
    """One format: its ``data.format`` name, the suffixes ``auto`` knows it by (a directory: ``directory``),
    its reader, and the optional package it needs (None: the standard library reads it)."""

    name: str
    suffixes: tuple[str, ...]
    read: Callable[[Path], Rows]
    package: str | None = None
    directory: bool = False


FORMATS: dict[str, FileFormat] = {f.name: f for f in (
    FileFormat("jsonl", (".jsonl", ".ndjson"), _jsonl),
    FileFormat("json", (".json",), _json),
    FileFormat("csv", (".csv", ".tsv"), _csv),
    FileFormat("parquet", (".parquet", ".pq"), _parquet, package="pyarrow"),
    FileFormat("hf_disk", (), _hf_disk, package="datasets", directory=True),
)}


def pick_format(path: Path, name: str = "auto") -> FileFormat:
    """The format of ``path``: ``name`` when it is not ``auto``, else by what the path is."""
    if name != "auto":
        return FORMATS[name]
    if path.is_dir():
        return next(f for f in FORMATS.values() if f.directory)
    suffix = path.suffix.lower()
    for fmt in FORMATS.values():
        if suffix in fmt.suffixes:
            return fmt
    known = ", ".join(s for f in FORMATS.values() for s in f.suffixes)
    raise FormatError(f"{path}: no data format is known by the suffix {suffix or '(none)'!r} ({known}, or a "
                      "datasets directory); name one with data.format")


def read_rows(path: Path, name: str = "auto") -> Rows:
    """Every row of ``path`` as ``(where, number, row)`` (module docstring)."""
    fmt = pick_format(path, name)
    if fmt.directory != path.is_dir():
        what = "a directory" if fmt.directory else "a file"
        raise FormatError(f"{path}: data.format {fmt.name} reads {what}")
    return fmt.read(path)
