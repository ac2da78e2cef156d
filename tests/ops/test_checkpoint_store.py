"""CheckpointStore: the same commit protocol on a local directory and on S3 (a moto server process)."""

from __future__ import annotations

import boto3
import pytest

from rayrl.checkpoint import CheckpointError, CheckpointStore
from rayrl.config import ConfigError, load_config


def _save(store: CheckpointStore, step: int, payload: bytes = b"weights") -> None:
    directory = store.staging_dir(step)
    (directory / "rank0.pt").write_bytes(payload + str(step).encode())
    (directory / "sub").mkdir()
    (directory / "sub" / "extra.bin").write_bytes(b"x" * 10)
    store.commit(step, {"step": step, "policy_version": step * 2})


def _exercise(store: CheckpointStore) -> None:
    assert store.latest() is None
    _save(store, 1)
    _save(store, 2)
    # a save interrupted before its marker: files present, no pipeline.json -> not a checkpoint
    (store.staging_dir(3) / "rank0.pt").write_bytes(b"partial")
    assert store.steps() == [1, 2] and store.latest() == 2
    assert store.read_state(2) == {"step": 2, "policy_version": 4}  # what the driver reads to resume
    directory = store.download(2)  # what each trainer rank reads
    assert (directory / "rank0.pt").read_bytes() == b"weights2"
    assert (directory / "sub" / "extra.bin").read_bytes() == b"x" * 10
    with pytest.raises(CheckpointError, match=r"checkpoint step 3 at .*: cannot read pipeline.json"):
        store.read_state(3)


def test_local_directory(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", staging_root=tmp_path / "staging")
    _exercise(store)
    assert not (tmp_path / "staging").exists()  # local checkpoints are written in place


def test_s3_round_trip_and_marker_last(tmp_path, s3_endpoint):
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="ckpts")
    store = CheckpointStore("s3://ckpts/runs/exp1", staging_root=tmp_path / "staging")
    _exercise(store)
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="ckpts")["Contents"])
    assert "runs/exp1/step000002/pipeline.json" in keys and "runs/exp1/step000002/sub/extra.bin" in keys
    assert not any(k.startswith("runs/exp1/step000003") for k in keys)  # never uploaded: not committed
    # a fresh store (a resumed driver on another machine) sees the same checkpoints
    again = CheckpointStore("s3://ckpts/runs/exp1/", staging_root=tmp_path / "elsewhere")
    assert again.latest() == 2 and again.read_state(1)["policy_version"] == 2


@pytest.mark.parametrize("remote", [False, True])
def test_keep_last_prunes_oldest(tmp_path, remote, request):
    if remote:
        request.getfixturevalue("s3_endpoint")
        boto3.client("s3").create_bucket(Bucket="prune")
        location = "s3://prune/p"
    else:
        location = str(tmp_path / "ckpt")
    store = CheckpointStore(location, staging_root=tmp_path / "staging", keep_last=2)
    for step in range(1, 5):
        _save(store, step)
    assert store.steps() == [3, 4]


def test_missing_bucket_is_a_clear_error(tmp_path, s3_endpoint):
    store = CheckpointStore("s3://no-such-bucket/x", staging_root=tmp_path)
    with pytest.raises(CheckpointError, match="s3://no-such-bucket/x is not usable"):
        store.verify()


def test_config_rejects_s3_uri_without_bucket():
    with pytest.raises(ConfigError, match="pipeline.checkpoint_dir"):
        load_config(None, ["pipeline.checkpoint_dir=s3:///prefix"])
    with pytest.raises(ConfigError, match="pipeline.keep_checkpoints"):
        load_config(None, ["pipeline.keep_checkpoints=-1"])


def test_the_default_keeps_one_checkpoint_and_minus_one_saves_none():
    cfg = load_config(None)
    assert cfg.pipeline.keep_checkpoints == 1 and cfg.pipeline.checkpoint_interval == 0  # the newest, at the end
    assert load_config(None, ["pipeline.checkpoint_interval=-1"]).pipeline.checkpoint_interval == -1
    with pytest.raises(ConfigError, match="pipeline.checkpoint_interval: must be >= -1"):
        load_config(None, ["pipeline.checkpoint_interval=-2"])
