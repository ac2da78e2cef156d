"""NCCL communicators' GPU memory given back around offload and made again at onload (issue 25 point 6).

One GPU, so a world of size 1 (NCCL refuses two ranks of one communicator on the same device): the trainer
world of rayrl/trainers/process_groups.py on NCCL, eight more groups made with ``torch.distributed.new_group``
(as Megatron's parallel state makes its TP/PP/DP/CP groups), each used once so its communicator exists, and
a broadcast group of rayrl/weights/group.py (the ``distributed`` weight transport's, destroyed by
``WeightSync.release_groups`` before the trainer lends its GPU). The GPU memory in use (the driver's view)
is measured:

- with the groups live (``held``), after the broadcast group is destroyed, after ``TrainerWorld.release``
  (``released``: what the communicators held must come back), then with the trainer's weights paused by
  torch_memory_saver (the offload order: groups first, then the memory, as slime's sleep);
- after onload (memory resumed, then the groups made again): every group's collective works on the same
  handles and the weights are intact; a second offload/onload cycle gives back as much again (no leak).

Runs in a subprocess started with torch_memory_saver's preload hook and the trainers' NCCL environment
(``NCCL_CUMEM_ENABLE=0``, rayrl/engines/backends/sglang.py), as a GPU trainer rank is started. Figures:
$OUT/nccl_release.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayrl.ports import free_port

pytestmark = pytest.mark.gpu

GROUPS = 8
MIB = 2**20


def _used() -> int:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _measure(out: Path) -> None:
    """The subprocess: one trainer rank's offload/onload cycle on NCCL, figures to ``out``."""
    import torch
    import torch.distributed as dist

    from rayrl.trainers.memory_saver import MemorySaver
    from rayrl.trainers.process_groups import GroupsReleasedError, TrainerWorld, offload_rank, onload_rank
    from rayrl.weights.group import destroy_group, init_custom_process_group

    figures: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())), "groups": GROUPS,
                     "NCCL_CUMEM_ENABLE": os.environ.get("NCCL_CUMEM_ENABLE")}
    torch.cuda.set_device(0)
    # NCCL's kernels and the CUDA context's share of it load on first use and stay: a throwaway group first
    warm = init_custom_process_group("nccl", "127.0.0.1", free_port(), 0, 1, "rayrl-warmup", timeout_s=120)
    dist.all_reduce(torch.ones(1, device="cuda"), group=warm)
    destroy_group(warm)

    saver = MemorySaver(enabled=True, tag="nccl-release-test")
    figures["saver_active"] = saver.active
    with saver.region():
        weights = torch.randn(128 * MIB // 4 * 8, device="cuda")  # 1 GiB standing for the trainer's state
    checksum = float(weights.double().sum())
    figures["baseline"] = _used()

    world = TrainerWorld(0, 1, "nccl", "127.0.0.1", free_port(), timeout_s=120).start()
    groups = [dist.new_group([0]) for _ in range(GROUPS)]

    def collectives() -> list[float]:
        out = []
        for g in [None, *groups]:
            t = torch.full((1024,), 2.0, device="cuda")
            dist.all_reduce(t, group=g)
            out.append(float(t.sum()))
        return out

    figures["collectives_before"] = collectives()
    broadcast = init_custom_process_group("nccl", "127.0.0.1", free_port(), 0, 1, "rayrl-weights-test",
                                          timeout_s=120)
    dist.broadcast(torch.ones(MIB, device="cuda"), src=0, group=broadcast)
    figures["held"] = _used()
    destroy_group(broadcast)  # WeightSync.release_groups: the broadcast group goes first
    figures["broadcast_released"] = _used()

    class Trainer:  # the trainer's offload/onload: its memory paused and resumed by torch_memory_saver
        def offload(self) -> bool:
            return saver.pause()

        def onload(self) -> bool:
            return saver.resume()

    trainer = Trainer()
    figures["release"] = world.release()
    figures["released"] = _used()
    try:
        dist.all_reduce(torch.ones(1, device="cuda"), group=groups[0])
        figures["collective_while_released"] = "ran"
    except GroupsReleasedError:
        figures["collective_while_released"] = "refused"
    figures["offload_moved"] = offload_rank(world, trainer)  # groups already released: then the memory
    figures["offloaded"] = _used()
    figures["onload_moved"] = onload_rank(world, trainer)  # memory, then the groups made again
    figures["weights_intact"] = float(weights.double().sum()) == checksum
    figures["collectives_after"] = collectives()
    figures["held_again"] = _used()
    offload_rank(world, trainer)
    figures["offloaded_again"] = _used()
    onload_rank(world, trainer)
    figures["collectives_after_second"] = collectives()
    figures["log"] = world.log
    world.close()
    figures["done"] = True
    out.write_text(json.dumps(figures, indent=2))


def test_nccl_groups_give_their_memory_back_at_offload_and_work_after_onload(tmp_path):
    from _gpu_kit import need, record

    need("torch_memory_saver")
    from rayrl.engines.backends.sglang import NCCL_ENV
    from rayrl.trainers.saver_preload import preload_env

    out = tmp_path / "figures.json"
    env = {**os.environ, **NCCL_ENV, **preload_env(True)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=75)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert out.exists(), f"exit {proc.returncode}: {tail}"
    f = json.loads(out.read_text())
    f["exit_code"] = proc.returncode
    nccl_held = f["held"] - f["baseline"]
    given_back = f["held"] - f["released"]
    f.update(nccl_held_mib=nccl_held / MIB, broadcast_given_back_mib=(f["held"] - f["broadcast_released"]) / MIB,
             groups_given_back_mib=(f["broadcast_released"] - f["released"]) / MIB, given_back_mib=given_back / MIB,
             left_after_release_mib=(f["released"] - f["baseline"]) / MIB,
             paused_mib=(f["released"] - f["offloaded"]) / MIB,
             second_cycle_given_back_mib=(f["held_again"] - f["offloaded_again"]) / MIB)
    record("nccl_release", f)
    assert f["done"] and f["saver_active"] and proc.returncode == 0, tail
    expected = [2.0 * 1024] * (GROUPS + 1)  # a world of one: all_reduce leaves the values as they are
    assert f["collectives_before"] == f["collectives_after"] == f["collectives_after_second"] == expected
    assert f["collective_while_released"] == "refused"
    assert f["log"] == ["world nccl", "world gloo", "released", "world nccl", "remade", "world gloo", "released",
                        "world nccl", "remade"]
    assert f["weights_intact"] and f["release"] and f["offload_moved"] and f["onload_moved"]
    assert nccl_held > 0, f  # the communicators hold GPU memory while live ...
    assert given_back > 0 and f["released"] < f["held"], f  # ... and give it back when released
    assert f["released"] - f["baseline"] <= max(nccl_held // 4, 8 * MIB), f  # (most of it; the rest is the driver's)
    assert f["offloaded"] <= f["released"] - 900 * MIB, f  # then the paused weights' 1 GiB
    # the second cycle gives back what the first did: groups made again are destroyed again, nothing leaks
    assert abs(f["offloaded_again"] - f["offloaded"]) <= max(nccl_held // 4, 8 * MIB), f


if __name__ == "__main__":
    _measure(Path(sys.argv[1]))
