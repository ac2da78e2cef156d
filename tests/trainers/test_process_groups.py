"""The trainer world's process groups destroyed and made again around offload/onload (issue 25 point 6).

Two real processes on gloo, with the release switched on (on NCCL it is on by default; tests/gpu/
test_gpu_nccl_release.py measures the GPU memory it gives back). Each rank makes a group with
``torch.distributed.new_group`` (as Megatron's parallel state does) and keeps the handle; after
``release`` a collective on it fails saying why, while rank queries and a CPU barrier still work; after
``remake`` the same handle runs collectives again, point-to-point included, and so does WORLD.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

from rayrl.ports import free_port


class _RecordingTrainer:
    """Says whether the groups were released when its memory moved (the order offload/onload must keep)."""

    def __init__(self, world) -> None:
        self.world = world
        self.seen: list[tuple[str, bool]] = []

    def offload(self) -> bool:
        self.seen.append(("offload", self.world.released))
        return True

    def onload(self) -> bool:
        self.seen.append(("onload", self.world.released))
        return True


def _rank(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rayrl.trainers.process_groups import GroupsReleasedError, TrainerWorld, offload_rank, onload_rank

    report: dict = {}
    world = TrainerWorld(rank, 2, "gloo", "127.0.0.1", port, timeout_s=60, releasable=True).start()
    try:
        group = dist.new_group([0, 1])
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=group)
        report["before"] = t.item()
        trainer = _RecordingTrainer(world)
        report["offload_moved"] = offload_rank(world, trainer)
        try:
            dist.all_reduce(torch.ones(1), group=group)
            report["released_error"] = None
        except GroupsReleasedError as err:
            report["released_error"] = str(err)
        report["rank_while_released"] = dist.get_rank()
        dist.barrier()  # the gloo stand-in WORLD: CPU barriers keep working
        report["onload_moved"] = onload_rank(world, trainer)
        report["seen"] = trainer.seen
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=group)  # the same handle, on the group made again
        report["after"] = t.item()
        peer = torch.full((2,), float(rank))
        other = torch.empty(2)
        ops = [dist.P2POp(dist.isend, peer, 1 - rank, group=group),
               dist.P2POp(dist.irecv, other, 1 - rank, group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        report["p2p"] = other.tolist()
        w = torch.tensor([10.0 * (rank + 1)])
        dist.all_reduce(w)
        report["world"] = w.item()
        report["second_cycle"] = [world.release(), world.remake(), world.release(), world.release(), world.remake()]
        t = torch.tensor([1.0])
        dist.all_reduce(t, group=group)
        report["after_second"] = t.item()
        report["log"] = world.log
        report["groups"] = world.groups
    finally:
        world.close()
        Path(out).write_text(json.dumps(report))


def test_groups_are_released_and_made_again_around_offload(tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, port, str(outs[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0], [p.exitcode for p in procs]
    for rank, out in enumerate(outs):
        report = json.loads(out.read_text())
        assert report["before"] == report["after"] == 3.0
        assert "released while the trainer is offloaded" in report["released_error"], report
        assert report["rank_while_released"] == rank
        # the groups go before the memory is paused, and come back after it is resumed (slime's order)
        assert report["seen"] == [["offload", True], ["onload", True]]
        assert report["offload_moved"] and report["onload_moved"]
        assert report["p2p"] == [float(1 - rank)] * 2
        assert report["world"] == 30.0
        assert report["second_cycle"] == [True, True, True, False, True]  # a second release is a no-op
        assert report["after_second"] == 2.0
        assert report["groups"] == 1
        assert report["log"] == ["world gloo"] + ["world gloo", "released", "world gloo", "remade"] * 3


def test_a_world_that_is_not_releasable_keeps_its_groups():
    """gloo without the switch (the CPU default): offload/onload leave the world alone."""
    from rayrl.trainers.process_groups import TrainerWorld

    world = TrainerWorld(0, 1, "gloo", "127.0.0.1", 0)
    assert not world.releasable and TrainerWorld(0, 1, "nccl", "127.0.0.1", 0).releasable
    assert world.release() is False and world.remake() is False and world.log == []


def _rank_whose_peer_dies(rank: int, port: int, out: str) -> None:
    import os
    import time

    from rayrl.trainers.process_groups import RankMissingError, TrainerWorld, offload_rank, onload_rank

    world = TrainerWorld(rank, 2, "gloo", "127.0.0.1", port, timeout_s=60, releasable=True, meet_timeout_s=2).start()
    if rank == 1:
        os._exit(0)  # its node lost: it never reaches the release
    trainer = _RecordingTrainer(world)
    started = time.monotonic()
    try:
        offload_rank(world, trainer)
        error = None
    except RankMissingError as err:
        error = str(err)
    report = {"error": error, "waited_s": time.monotonic() - started,
              "memory_only": onload_rank(None, trainer), "seen": trainer.seen}  # the survivor's checkpoint onload
    Path(out).write_text(json.dumps(report))
    os._exit(0)  # torch's atexit would wait on the dead peer


def test_a_release_whose_peer_died_gives_up_and_the_survivor_can_still_onload(tmp_path):
    """A rank whose peer died (its node lost) before the release does not wait the collective timeout (30 min
    on a real run) for the meeting: it raises RankMissingError after ``meet_timeout_s`` and stays alive, and
    its memory comes back without the groups (how a survivor onloads to write the checkpoint)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    out = tmp_path / "rank0.json"
    procs = [ctx.Process(target=_rank_whose_peer_dies, args=(r, port, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    report = json.loads(out.read_text())
    assert "not every rank reached the release" in report["error"] and "within 2 s" in report["error"], report
    assert report["waited_s"] < 30
    assert report["memory_only"] and report["seen"] == [["onload", False]]  # its memory never went: it raised first
