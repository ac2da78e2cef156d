"""The data file contract (JSONL; the other formats and the field mapping: tests/data/test_data_formats.py),
the resumable sampler, and the numeric-answer reward."""

import json

import pytest

from rayrl.agents.base import AgentResult
from rayrl.data.dataset import DatasetError, FileDataset, TaskSampler
from rayrl.rewards import get_reward_fn
from rayrl.rewards.math import extract_number, numeric_answer_reward
from rayrl.types import Task


def write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_metadata_is_payload_verbatim_and_a_shallow_copy(tmp_path):
    meta = {"question": "q", "answer": 3, "nested": {"k": [1]}}
    ds = FileDataset(write(tmp_path / "d.jsonl", [{"prompt": "p", "label": "ignored", "metadata": meta}]))
    task = ds[0]
    payload = task.payload()
    assert payload == meta  # verbatim: prompt/label are not mixed in
    payload["answer"] = 99
    payload["extra"] = 1
    assert task.metadata == meta  # mutating the payload never changes the dataset
    assert payload["nested"] is task.metadata["nested"]  # shallow copy


def test_missing_metadata_is_an_empty_payload(tmp_path):
    ds = FileDataset(write(tmp_path / "d.jsonl", [{"prompt": "p"}, {"prompt": "q", "metadata": None}]))
    assert ds[0].payload() == {} and ds[1].payload() == {}


@pytest.mark.parametrize("metadata", ["str", [1, 2], 5])
def test_non_object_metadata_is_an_error_not_a_silent_empty_payload(tmp_path, metadata):
    with pytest.raises(DatasetError, match=r"d.jsonl:2: 'metadata' must be an object"):
        FileDataset(write(tmp_path / "d.jsonl", [{"prompt": "p"}, {"prompt": "p", "metadata": metadata}]))


def test_every_bad_row_is_counted_and_the_first_ones_named(tmp_path):
    rows = ['{"prompt": "ok"}', "{broken", '{"question": "no prompt"}', "[1, 2]"] + ['{"prompt": 3}'] * 5
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(DatasetError) as info:
        FileDataset(path)
    message = str(info.value)
    assert "\n" not in message and "(8 bad rows in all)" in message
    assert "many.jsonl:2: invalid JSON" in message
    assert "many.jsonl:3: no field 'prompt' (data.fields.prompt); the row has: question" in message
    assert "many.jsonl:4: a row must be an object, got list" in message and "many.jsonl:6:" in message
    assert "many.jsonl:7:" not in message  # the first five are named


def test_prompt_drives_length_filter_and_errors_name_the_line(tmp_path):
    ds = FileDataset(write(tmp_path / "d.jsonl", [{"prompt": "short"}, {"prompt": "x" * 100}]), max_prompt_chars=10)
    assert len(ds) == 1 and ds.filtered == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{broken\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        FileDataset(bad)
    with pytest.raises(DatasetError, match="no row has the field 'prompt'"):
        FileDataset(write(tmp_path / "np.jsonl", [{"metadata": {}}]))


def test_sampler_resumes_exactly(tmp_path):
    ds = FileDataset(write(tmp_path / "d.jsonl", [{"prompt": str(i), "id": i} for i in range(10)]))
    a = TaskSampler(ds, seed=7)
    first = [t.task_id for t in a.next(7)]
    state = a.state_dict()
    rest = [t.task_id for t in a.next(13)]
    b = TaskSampler(ds, seed=7)
    b.load_state_dict(state)
    assert [t.task_id for t in b.next(13)] == rest
    # each epoch is a permutation: the first 10 draws cover every task once
    assert sorted((first + rest)[:10]) == sorted(str(i) for i in range(10))


def test_numeric_reward():
    task = Task(prompt="What is 6*7?", metadata={"answer": 42})
    ok = AgentResult(final_answer="The answer is 42.", status="completed")
    assert numeric_answer_reward(task, ok) == 1.0
    assert numeric_answer_reward(task, AgentResult(final_answer="6*7 = 42? No, it is 41", status="completed")) == 0.0
    assert numeric_answer_reward(task, AgentResult(final_answer="The answer is 42", status="error")) == 0.0
    assert numeric_answer_reward(task, AgentResult(final_answer="1,042", status="completed")) == 0.0
    assert extract_number("answer: -1,234.5") == -1234.5
    assert get_reward_fn("calculator") is numeric_answer_reward
    with pytest.raises(ValueError, match="rollout.reward"):
        get_reward_fn("nope")


def test_every_reward_row_names_an_implementation_that_imports() -> None:
    from rayrl.extensions import load_reference
    from rayrl.rewards import REWARDS

    for row in REWARDS.values():
        assert callable(load_reference(row.implementation, "rollout.reward")), row.name
