"""The user's data as it is (issue 43): every format rayrl/data/formats.py reads, written by its own writer
(json, csv, pyarrow, datasets), gives the same tasks through the same field mapping (``data.fields``); what a
format cannot read, or a mapping names wrong, is one line naming the file."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from rayrl.config import ConfigError, DataFields, load_config
from rayrl.data.dataset import DatasetError, FileDataset
from rayrl.data.formats import FORMATS

ROWS = [{"question": "What is 2 + 2?", "answer": 4, "level": "easy", "id": "q1"},
        {"question": "What is 6 * 7?", "answer": 42, "level": "hard", "id": "q2"}]
MAPPED = DataFields(prompt="question", answer="answer", metadata_fields=["level"])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path: Path, rows: list[dict], delimiter: str = ",") -> Path:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_hf_disk(path: Path, rows: list[dict]) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


WRITERS = {
    "jsonl": lambda d: write_jsonl(d / "qa.jsonl", ROWS),
    "json-array": lambda d: _text(d / "qa.json", json.dumps(ROWS, indent=1)),
    "json-object": lambda d: _text(d / "qa.json", json.dumps({"version": "1", "data": ROWS})),
    "json-lines-named-json": lambda d: write_jsonl(d / "qa.json", ROWS),  # what datasets' to_json writes
    "csv": lambda d: write_csv(d / "qa.csv", ROWS),
    "tsv": lambda d: write_csv(d / "qa.tsv", ROWS, "\t"),
    "parquet": lambda d: write_parquet(d / "qa.parquet", ROWS),
    "hf_disk": lambda d: write_hf_disk(d / "qa_dataset", ROWS),
}


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("kind", list(WRITERS))
def test_every_format_gives_the_same_tasks_through_the_mapping(tmp_path, kind):
    ds = FileDataset(WRITERS[kind](tmp_path), fields=MAPPED)
    assert [t.prompt for t in ds] == ["What is 2 + 2?", "What is 6 * 7?"]
    assert [t.task_id for t in ds] == ["q1", "q2"]
    text = kind in ("csv", "tsv")  # every CSV value is text; the numeric reward reads "4" as 4
    assert [t.metadata for t in ds] == [{"answer": "4" if text else 4, "level": "easy"},
                                        {"answer": "42" if text else 42, "level": "hard"}]


def test_the_default_mapping_refuses_other_names_once_with_the_file_and_its_fields(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", ROWS)
    with pytest.raises(DatasetError) as info:
        FileDataset(path)
    assert str(info.value) == (f"{path}: no row has the field 'prompt' (data.fields.prompt); the rows have: "
                               "question, answer, level, id; map yours, e.g. data.fields.prompt: <one of them>")


def test_a_field_some_rows_lack_names_those_rows(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [*ROWS, {"question": "What is 1 + 1?"}])
    assert FileDataset(path, fields=DataFields(prompt="question"))[2].metadata == {}  # nothing else is required
    with pytest.raises(DatasetError, match=rf"^{path}:3: no field 'answer' \(data.fields.answer\); the row has: "
                                           r"question$"):
        FileDataset(path, fields=MAPPED)


def test_a_csv_row_whose_cells_do_not_line_up_with_the_header(tmp_path):
    path = tmp_path / "ragged.csv"
    path.write_text("question,answer\nq,1\nq,2,extra\nq\nq,\n")  # the last row's empty answer is a cell
    with pytest.raises(DatasetError) as info:
        FileDataset(path, fields=DataFields(prompt="question"))
    assert str(info.value) == (f"{path}:3: 3 cells, the header has 2 fields; "
                               f"{path}:4: 1 cells, the header has 2 fields")
    twice = _text(tmp_path / "twice.csv", "question,answer,answer\nq,1,2\n")
    with pytest.raises(DatasetError, match="the header names 'answer' more than once"):
        FileDataset(twice, fields=DataFields(prompt="question"))


def test_all_other_fields_and_a_metadata_object_in_a_csv_cell(tmp_path):
    rows = [{"q": "p1", "metadata": json.dumps({"files": {"a.py": "x = 1"}}), "difficulty": "3", "topic": "py"}]
    ds = FileDataset(write_csv(tmp_path / "t.csv", rows), fields=DataFields(prompt="q", metadata_fields=["*"]))
    assert ds[0].metadata == {"files": {"a.py": "x = 1"}, "difficulty": "3", "topic": "py"}
    assert ds[0].task_id == "t-2"  # no id field: the file's stem and the row's line
    bad = write_csv(tmp_path / "bad.csv", [{**rows[0], "metadata": "[1, 2]"}])
    with pytest.raises(DatasetError, match=r"bad.csv:2: 'metadata' must be an object \(data.fields.metadata\)"):
        FileDataset(bad, fields=DataFields(prompt="q"))


def test_what_a_format_cannot_read_is_one_line(tmp_path):
    cases = {
        _text(tmp_path / "two.json", json.dumps({"a": [], "b": []})): "an object holding one array (got an object "
                                                                       "with 2 arrays)",
        _text(tmp_path / "scalar.json", "3"): "is an array of rows, got int",
        _text(tmp_path / "broken.json", '[{"question": "x"},'): "invalid JSON at line 1",
        _text(tmp_path / "empty.csv", ""): "no header line",
        _text(tmp_path / "tasks.xlsx", "PK"): "no data format is known by the suffix '.xlsx'",
        _text(tmp_path / "not.parquet", "not parquet"): "not a readable Parquet file",
    }
    for path, message in cases.items():
        if path.suffix == ".parquet":
            pytest.importorskip("pyarrow")
        with pytest.raises(DatasetError) as info:
            FileDataset(path)
        assert message in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)
    plain_dir = tmp_path / "plain_dir"
    plain_dir.mkdir()
    with pytest.raises(DatasetError, match="data.format jsonl reads a file"):
        FileDataset(plain_dir, format="jsonl")


def test_a_datasets_dict_names_its_splits_and_one_split_reads(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "qa_splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(path))
    with pytest.raises(DatasetError, match=rf"holds the splits train, test; point the path at one split's "
                                           rf"directory \({path / 'train'}\)"):
        FileDataset(path, fields=MAPPED)
    assert len(FileDataset(path / "test", fields=MAPPED)) == 1


@pytest.mark.parametrize("module, writer, message", [
    ("pyarrow", "parquet", "reading Parquet needs pyarrow: pip install pyarrow"),
    ("datasets", "hf_disk", "a Hugging Face datasets directory needs the datasets package"),
])
def test_a_missing_optional_package_is_a_clear_load_error(tmp_path, monkeypatch, module, writer, message):
    path = WRITERS[writer](tmp_path)
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # what `import` finds when the package is not installed
    with pytest.raises(DatasetError, match=message):
        FileDataset(path, fields=MAPPED)


def test_the_config_maps_fields_and_names_formats(tmp_path):
    path = write_parquet(tmp_path / "qa.parquet", ROWS)
    cfg = load_config(None, [f"data.train_path={path}", "data.fields.prompt=question", "data.fields.answer=answer",
                             "data.fields.metadata_fields=[level]", "data.format=parquet"])
    ds = FileDataset(cfg.data.train_path, cfg.data.max_prompt_chars, cfg.data.fields, cfg.data.format)
    assert ds[1].metadata == {"answer": 42, "level": "hard"}
    with pytest.raises(ConfigError, match="data.fields.prompt: must name a field"):
        load_config(None, ['data.fields.prompt=""'])
    assert set(FORMATS) == {"jsonl", "json", "csv", "parquet", "hf_disk"}
