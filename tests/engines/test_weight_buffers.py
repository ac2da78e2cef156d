"""Weight buffers in shared memory never outlive their owner (rayrl/weights/shm.py).

A real owner process (a subprocess that makes a buffer and a disk-transport directory, as a trainer rank
does) is killed with SIGKILL, which no cleanup code survives: its files stay until a trainer rank or an
engine actor starts on the node and sweeps them. Buffers of live processes are never touched, a pid the
kernel reused for another process does not protect a dead owner's file, and an owner that exits or closes
removes its own. The engine opens a buffer only by a name of that form.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import ray
import torch

from rayrl.weights.shm import SharedBuffer, owner_tag, shared_memory_root, sweep_dead_buffers
from rayrl.weights.wire import WeightUpdateError, deserialize_from_trainer, flatten_bucket, serialize_for_engine

ROOT = Path(__file__).resolve().parents[2]

OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from rayrl.weights.shm import SharedBuffer, owner_tag

    buffer = SharedBuffer(1 << 20)
    buffer.typed(torch.float32, 4).copy_(torch.arange(4.0))
    weights = Path(sys.argv[1]) / f"rank0-{owner_tag()}" / "v000001"  # the disk transport's layout
    weights.mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(b"x" * 4096)
    print(buffer.name, weights.parent, flush=True)
    if sys.argv[2] == "sleep":
        time.sleep(600)
""")


def _owner(run_dir: Path, mode: str) -> tuple[subprocess.Popen, Path, Path]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(run_dir), mode], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    name, directory = proc.stdout.readline().split()
    return proc, shared_memory_root() / name, Path(directory)


def _sigkill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)


@pytest.fixture
def run_dir():
    path = shared_memory_root() / f"rayrl-bufs{uuid.uuid4().hex[:8]}-weights"  # where WeightSync puts a run's
    yield path
    for child in path.glob("*"):
        for f in sorted(child.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        child.rmdir()
    path.rmdir() if path.exists() else None


def test_sigkilled_owner_is_swept_when_a_trainer_rank_or_engine_starts(ray_local, run_dir, tiny_model_dir, tmp_path):
    from actors.engine import EngineActor
    from actors.trainer import TrainerRank
    from rayrl.config import EngineConfig, TrainerConfig

    owner, buffer, weights = _owner(run_dir, "sleep")
    try:
        assert buffer.stat().st_size == 1 << 20 and weights.is_dir()
        assert buffer.name not in sweep_dead_buffers()  # a live owner's buffer is left alone
        assert buffer.exists() and weights.exists()
    finally:
        _sigkill(owner)
    assert buffer.exists() and weights.exists()  # SIGKILL ran no cleanup: without a sweep they stay

    rank = TrainerRank.remote(str(tiny_model_dir), TrainerConfig(), 0, 1, 0)
    ray.get(rank.place.remote())  # started: its __init__ swept the node
    assert not buffer.exists() and not weights.exists()
    ray.kill(rank)

    owner, buffer, weights = _owner(run_dir, "sleep")
    _sigkill(owner)
    cfg = EngineConfig(backend="cpu", dtype="float32", max_batch_size=2, context_length=256, num_threads=1,
                       startup_timeout_s=180)
    engine = EngineActor.remote(cfg, str(tiny_model_dir), str(tmp_path / "logs"), 0)
    try:
        ray.get(engine.info.remote())
        assert not buffer.exists() and not weights.exists()
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine)


def test_buffers_leave_with_their_owner_and_open_only_by_their_own_names(run_dir):
    buffer = SharedBuffer(1 << 16)
    named = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(5))]
    payload = serialize_for_engine(flatten_bucket(named, out=buffer.typed(torch.float32, 11)))
    raw = base64.b64decode(payload)
    assert b"open_buffer" in raw and b"rebuild_storage_filename" not in raw  # by our name, not torch's file
    got = dict(deserialize_from_trainer(payload))
    assert torch.equal(got["a"], named[0][1]) and torch.equal(got["b"], named[1][1])
    packed = dict(deserialize_from_trainer(serialize_for_engine(buffer.pack(
        [("c", torch.arange(3, dtype=torch.bfloat16)), ("d", torch.arange(4, dtype=torch.int64))]))))
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
        deserialize_from_trainer(payload)

    owner, path, weights = _owner(run_dir, "exit")  # exits without closing: removed at interpreter exit
    assert owner.wait(30) == 0 and not path.exists()

    for name in ("../../etc/passwd", "torch_1_2_3", f"rayrl-wbuf-{owner_tag()}-zz"):  # only our names open
        buf = io.BytesIO()
        pickle.Pickler(buf).dump(_ForgedRef(name))
        with pytest.raises(WeightUpdateError, match="not a rayrl weight buffer name"):
            deserialize_from_trainer(base64.b64encode(buf.getvalue()).decode())


class _ForgedRef:
    """A payload that names an arbitrary file through the admitted function."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):
        from rayrl.weights.shm import open_buffer

        return open_buffer, (self.name, 0, (4,), torch.uint8)
