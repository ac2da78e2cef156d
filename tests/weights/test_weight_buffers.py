"""Weight buffers in shared memory never outlive their owner (rayrl/weights/shm.py).

A real owner process (tests/shm_support.py: it makes a buffer and a disk-transport directory, as a
trainer rank does) is killed with SIGKILL, which no cleanup code survives: its files stay until a sweep,
which leaves a live owner's files alone. A pid the kernel reused for another process does not protect a
dead owner's file, and an owner that exits or closes removes its own. The engine opens a buffer only by
a name of that form. That trainer ranks and engine actors sweep when they start is checked where they
start anyway: tests/pipeline/test_trainer_failure.py and tests/engines/test_engine_fleet.py.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import uuid

import pytest
import torch

from rayrl.weights.owners import owner_tag, shared_memory_root, sweep_dead_buffers
from rayrl.weights.shm import SharedBuffer
from rayrl.weights.wire import WeightUpdateError, deserialize_entry, flatten_bucket, serialize_for_engine
from tests.shm_support import run_weights_dir, sigkill, start_owner


@pytest.fixture
def run_dir():
    with run_weights_dir() as path:
        yield path


def test_a_sigkilled_owners_buffers_are_swept_and_a_live_owners_kept(run_dir):
    owner, buffer, weights = start_owner(run_dir)
    try:
        assert buffer.stat().st_size == 1 << 20 and weights.is_dir()
        assert buffer.name not in sweep_dead_buffers()  # a live owner's buffer is left alone
        assert buffer.exists() and weights.exists()
    finally:
        sigkill(owner)
    assert buffer.exists() and weights.exists()  # SIGKILL ran no cleanup: without a sweep they stay
    removed = sweep_dead_buffers()
    assert buffer.name in removed and f"{run_dir.name}/{weights.name}" in removed
    assert not buffer.exists() and not weights.exists()


def test_buffers_leave_with_their_owner_and_open_only_by_their_own_names(run_dir):
    buffer = SharedBuffer(1 << 16)
    named = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(5))]
    payload = serialize_for_engine(flatten_bucket(named, out=buffer.typed(torch.uint8, 11 * 4)))  # bytes, any dtypes
    raw = base64.b64decode(payload)
    assert b"open_buffer" in raw and b"rebuild_storage_filename" not in raw  # by our name, not torch's file
    got = dict(deserialize_entry(payload)[0])
    assert torch.equal(got["a"], named[0][1]) and torch.equal(got["b"], named[1][1])
    packed = dict(deserialize_entry(serialize_for_engine(buffer.pack(
        [("c", torch.arange(3, dtype=torch.bfloat16)), ("d", torch.arange(4, dtype=torch.int64))])))[0])
    assert packed["c"].dtype == torch.bfloat16 and torch.equal(packed["d"], torch.arange(4))

    # a pid now held by another process (this one, with another start time) protects nothing
    stale = shared_memory_root() / f"rayrl-wbuf-{os.getpid()}-1-{uuid.uuid4().hex[:12]}"
    gone = shared_memory_root() / f"rayrl-wbuf-{2**22 + 17}-5-{uuid.uuid4().hex[:12]}"  # past any pid_max
    stale.write_bytes(b"")
    gone.write_bytes(b"")
    removed = sweep_dead_buffers()
    assert {stale.name, gone.name} <= set(removed) and buffer.name not in removed and buffer.path.exists()
    assert not stale.exists() and not gone.exists()

    buffer.close()  # the owner's exit path: the file goes
    assert not buffer.path.exists()
    with pytest.raises(WeightUpdateError, match="is gone"):
        deserialize_entry(payload)

    owner, path, weights = start_owner(run_dir, "exit")  # exits without closing: removed at interpreter exit
    assert owner.wait(30) == 0 and not path.exists()

    for name in ("../../etc/passwd", "torch_1_2_3", f"rayrl-wbuf-{owner_tag()}-zz"):  # only our names open
        buf = io.BytesIO()
        pickle.Pickler(buf).dump(_ForgedRef(name))
        with pytest.raises(WeightUpdateError, match="not a rayrl weight buffer name"):
            deserialize_entry(base64.b64encode(buf.getvalue()).decode())


class _ForgedRef:
    """A payload that names an arbitrary file through the admitted function."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):
        from rayrl.weights.shm import open_buffer

        return open_buffer, (self.name, 0, (4,), torch.uint8)
