"""TrainerGroup: trainer ranks in one placement group, joined by torch.distributed.

Each rank is a Ray actor over ``rayrl.trainers.torch_backend.TorchTrainer`` (gloo on CPU, NCCL on GPU).
The group splits a batch over the data-parallel replicas balanced by tokens and sends every rank its
replica's shard (``rayrl.rl.shard.rank_shards``: with Megatron's tensor/pipeline/context parallelism the
ranks of one replica train the same samples), so gradients are all-reduced over the whole batch and
every replica ends each step with identical weights.

New weights reach the engines from the ranks that rayrl/weights/routes.py picks (``connect_weights``
once, then ``push_weights`` after each step): every rank holds one sender or none, and never asks
which transport it is.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayrl.checkpoint import CheckpointStore
from rayrl.config import TrainerConfig
from rayrl.rl.shard import rank_shards, replica_leads
from rayrl.types import Sample
from rayrl.weights.routes import RankPlace, WeightRoutes, make_sender
from rayrl.weights.shm import sweep_quietly

FAILURE_GRACE_S = 60.0  # how long surviving ranks get to fail on their own once a peer has died


class TrainerFailure(RuntimeError):
    """A trainer rank died or raised during a step; the run must stop (replicas may have diverged).

    ``rank0_stepped``: rank 0 finished the step (its weights include it); ``rank0_alive``: rank 0 can
    still write a checkpoint.
    """

    def __init__(self, errors: dict[int, str], rank0_stepped: bool, rank0_alive: bool) -> None:
        self.errors = errors
        self.rank0_stepped = rank0_stepped
        self.rank0_alive = rank0_alive
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
        super().__init__(f"trainer rank failure: {detail}")


@ray.remote(num_cpus=1)
class TrainerRank:
    """One rank of the trainer."""

    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world_size: int, seed: int) -> None:
        sweep_quietly()  # weight buffers of killed processes on this node (rayrl/weights/shm.py)
        self.args = (model_path, cfg, rank, world_size, seed)
        self.trainer = None
        self.sender: Any = None  # this rank's weight sender (rayrl/weights/routes.py), or None
        self._loop: asyncio.AbstractEventLoop | None = None  # one loop for the sender's HTTP sessions

    def master_address(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ip, port

    def setup(self, master_addr: str, master_port: int) -> int:
        import torch.distributed as dist

        from rayrl.trainers.torch_backend import TorchTrainer

        model_path, cfg, rank, world_size, seed = self.args
        if world_size > 1:
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
            import torch

            # logical GPUs (ray.init(num_gpus=...) on a CPU machine) have ids but no CUDA: gloo then
            backend = "nccl" if ray.get_gpu_ids() and torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        if cfg.backend == "megatron":  # raises MegatronUnavailable naming what is missing (packages, CUDA)
            from rayrl.trainers.megatron_backend import MegatronTrainer

            os.environ.setdefault("MASTER_ADDR", master_addr)
            os.environ.setdefault("MASTER_PORT", str(master_port))
            self.trainer = MegatronTrainer(model_path, cfg, rank=rank, world_size=world_size, seed=seed, local_rank=0)
            return rank
        self.trainer = TorchTrainer(model_path, cfg, rank=rank, world_size=world_size, seed=seed)
        return rank

    def train_step(self, samples: list[Sample], advantages: list[float], global_tokens: int) -> dict[str, Any]:
        return self.trainer.train_step(samples, advantages, global_tokens)

    def export_weights(self, root: str, version: int, dtype: str) -> str:
        import torch

        from rayrl.weights.files import write_weights

        # Megatron: every rank must drain the export (it gathers over TP/PP); only rank 0 writes
        state = {name: t.detach().cpu() for name, t in self.trainer.named_weights(getattr(torch, dtype))}
        if self.args[2] != 0:
            return ""
        return str(write_weights(state, Path(root), version))

    def _run(self, coro: Any) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def place(self) -> dict[str, Any]:
        """Where this rank runs (for the weight routes and the layout checks)."""
        return {"rank": self.args[2], "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address()}

    def connect_weights(self, routes: WeightRoutes, disk_root: str, timeout_s: float) -> bool:
        """Build (and connect) the sender ``routes`` gives this rank, replacing any previous one; a rank
        that feeds no engine holds none. Returns whether this rank sends."""
        import torch

        self.close_weights()
        cfg = self.args[1]
        self.sender = make_sender(routes, self.args[2], bucket_bytes=cfg.weight_bucket_mb * 1024 * 1024,
                                  timeout_s=timeout_s, master_address=ray.util.get_node_ip_address(),
                                  disk_root=disk_root, cuda=torch.cuda.is_available())
        if self.sender is not None:
            self._run(self.sender.connect())
        return self.sender is not None

    def push_weights(self, version: int, dtype: str) -> dict[str, Any] | None:
        """Send the current weights as ``version`` to this rank's engines. Megatron ranks drain the
        gathered export whether or not they send (it runs collectives). Returns the transfer figures."""
        import torch

        weights = self.trainer.named_weights(getattr(torch, dtype))
        if self.sender is None:
            if self.args[1].backend == "megatron":
                for _ in weights:
                    pass
            return None
        return self._run(self.sender.send(weights, version)).as_dict()

    def close_weights(self) -> None:
        """Leave what the sender made (a broadcast group; engines that are gone are skipped)."""
        sender, self.sender = self.sender, None
        if sender is not None:
            self._run(sender.close())

    def save_checkpoint(self, directory: str) -> None:
        self.trainer.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> int:
        self.trainer.load_checkpoint(directory)
        return self.trainer.policy_version

    def clear_dir(self, directory: str) -> None:
        """Empty ``directory`` on this node (before the ranks here write a checkpoint into it)."""
        shutil.rmtree(directory, ignore_errors=True)
        Path(directory).mkdir(parents=True, exist_ok=True)

    def upload_checkpoint(self, location: str, staging_root: str, step: int, directory: str) -> int:
        """Upload what the ranks on this node wrote into ``directory`` to the store (S3)."""
        return CheckpointStore(location, staging_root).upload(step, directory)

    def download_checkpoint(self, location: str, staging_root: str, step: int) -> str:
        """Step ``step``'s files in a directory on this node (downloaded from S3)."""
        return str(CheckpointStore(location, staging_root).download(step))

    def sees(self, path: str) -> bool:
        return os.path.exists(path)

    def policy_version(self) -> int:
        return self.trainer.policy_version

    def offload(self) -> bool:
        return self.trainer.offload()

    def onload(self) -> bool:
        return self.trainer.onload()


class TrainerGroup:
    """Driver-side handle over the trainer ranks."""

    def __init__(
        self,
        cfg: TrainerConfig,
        model_path: str,
        seed: int = 0,
        name_prefix: str = "rayrl",
        placement: Any = None,
    ) -> None:
        """``placement`` (actors.placement_group.SharedPlacement): ranks go to the bundles it plans (shared
        with the engines when colocated); without it the group makes a placement group of its own."""
        self.cfg = cfg
        self.shared_placement = placement
        self.bundles: list[int] = []  # rank -> bundle of the shared placement (none of its own group)
        if placement is not None:
            self.placement_group = placement.group
            self.bundles = [placement.trainer_bundle(r) for r in range(cfg.num_ranks)]
            options = [placement.trainer_options(r) for r in range(cfg.num_ranks)]
        else:
            use_gpu = bool(ray.cluster_resources().get("GPU", 0))
            bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
            self.placement_group = placement_group([bundle] * cfg.num_ranks, strategy="PACK")
            ray.get(self.placement_group.ready())
            options = [
                {
                    "num_gpus": 1 if use_gpu else 0,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_group, placement_group_bundle_index=r
                    ),
                }
                for r in range(cfg.num_ranks)
            ]
        self.ranks = [
            TrainerRank.options(name=f"{name_prefix}-trainer-{r}", **options[r]).remote(
                model_path, cfg, r, cfg.num_ranks, seed
            )
            for r in range(cfg.num_ranks)
        ]
        addr, port = ray.get(self.ranks[0].master_address.remote())
        ray.get([r.setup.remote(addr, port) for r in self.ranks])

    def train(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, Any]:
        """One optimizer step over the batch on all ranks; returns rank 0's metrics, with
        ``trained_samples`` and ``trained_tokens`` summed over the replicas (one rank each) and
        ``train_time_s`` the slowest rank's.

        Raises TrainerFailure when a rank dies or fails: the ranks still running get
        ``FAILURE_GRACE_S`` to notice (gloo/NCCL raise when a peer's connection drops) and are then killed.
        """
        layout = (len(self.ranks), self.cfg.tp_size, self.cfg.pp_size, self.cfg.cp_size)
        shards = rank_shards([len(s.tokens) for s in samples], *layout)
        global_tokens = sum(s.num_trained_tokens for s, a in zip(samples, advantages) if a != 0.0)
        refs = [
            rank.train_step.remote([samples[i] for i in idx], [float(advantages[i]) for i in idx], global_tokens)
            for rank, idx in zip(self.ranks, shards)
        ]
        results = self._gather(refs)
        metrics = dict(results[0])
        # a replica's ranks all report its shard: count each replica once
        leads = [results[r] for r in replica_leads(*layout)]
        metrics["trained_samples"] = sum(r["trained_samples"] for r in leads)
        metrics["trained_tokens"] = sum(r["trained_tokens"] for r in leads)
        metrics["train_time_s"] = max(r["train_time_s"] for r in results)
        return metrics

    def _gather(self, refs: list[Any]) -> list[dict[str, Any]]:
        index = {ref: r for r, ref in enumerate(refs)}
        results: dict[int, dict[str, Any]] = {}
        errors: dict[int, str] = {}
        pending = list(refs)
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                break
            r = index[ready[0]]
            try:
                results[r] = ray.get(ready[0])
            except Exception as err:  # RayActorError (rank process died) or RayTaskError (it raised)
                cause = getattr(err, "cause", None) or err  # RayTaskError wraps what the rank raised
                text = str(cause).strip()
                errors[r] = f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"
                deadline = deadline or time.monotonic() + FAILURE_GRACE_S
        if not errors:
            return [results[r] for r in range(len(refs))]
        for ref in pending:
            errors[index[ref]] = f"no answer {FAILURE_GRACE_S:.0f} s after another rank failed; killed"
            ray.kill(self.ranks[index[ref]])
        raise TrainerFailure(errors, rank0_stepped=0 in results, rank0_alive=self._alive(0))

    def _alive(self, rank: int) -> bool:
        try:
            ray.get(self.ranks[rank].policy_version.remote(), timeout=30)
            return True
        except Exception:
            return False

    def export_weights(self, root: str, version: int, dtype: str) -> str:
        ranks = self.ranks if self.cfg.backend == "megatron" else self.ranks[:1]  # Megatron gathers: all ranks
        return ray.get([r.export_weights.remote(root, version, dtype) for r in ranks])[0]

    def places(self) -> list[RankPlace]:
        """Where each rank runs: its node and, in a shared placement, its bundle."""
        found = ray.get([r.place.remote() for r in self.ranks])
        bundles = self.bundles or [None] * len(self.ranks)
        return [RankPlace(int(f["rank"]), str(f["node_id"]), b) for f, b in zip(found, bundles)]

    def connect_weights(self, routes: WeightRoutes, disk_root: str, timeout_s: float) -> None:
        """Give every rank its sender under ``routes`` (rayrl/weights/routes.py) and connect them."""
        ray.get([r.connect_weights.remote(routes, disk_root, timeout_s) for r in self.ranks], timeout=timeout_s + 60)

    def push_weights(self, version: int, dtype: str) -> list[Any]:
        """Refs of every rank's part of one weight push (ranks without a sender return at once; Megatron
        ranks drain the export)."""
        return [r.push_weights.remote(version, dtype) for r in self.ranks]

    def close_weights(self) -> None:
        ray.get([r.close_weights.remote() for r in self.ranks], timeout=60)

    def node_leaders(self, ranks: Optional[Sequence[int]] = None) -> list[int]:
        """The lowest of ``ranks`` (default: all) on each node: who handles files for that node."""
        places = self.places()
        chosen = set(range(len(self.ranks)) if ranks is None else ranks)
        leaders: dict[str, int] = {}
        for p in places:
            if p.rank in chosen:
                leaders.setdefault(p.node_id, p.rank)
        return sorted(leaders.values())

    def save_checkpoint(self, directory: str, only_rank0: bool = False, store: Optional[CheckpointStore] = None,
                        step: int = 0) -> None:
        """Every rank writes its files into ``directory`` (on its own node); ``only_rank0`` after a rank
        failure (ranks hold replicas of the optimizer state, so rank 0's file restores all of them). With
        an S3 ``store`` one rank per node empties the directory first and uploads it after."""
        ranks = [0] if only_rank0 else list(range(len(self.ranks)))
        leaders = self.node_leaders(ranks) if store is not None and store.s3 is not None else []
        ray.get([self.ranks[r].clear_dir.remote(directory) for r in leaders])
        ray.get([self.ranks[r].save_checkpoint.remote(directory) for r in ranks])
        ray.get([self.ranks[r].upload_checkpoint.remote(store.location, str(store.staging_root), step, directory)
                 for r in leaders])

    def load_checkpoint(self, directory: str, store: Optional[CheckpointStore] = None, step: int = 0) -> int:
        """Every rank loads step ``step``; with an S3 ``store`` one rank per node downloads it first."""
        if store is not None and store.s3 is not None:
            found = ray.get([self.ranks[r].download_checkpoint.remote(store.location, str(store.staging_root), step)
                             for r in self.node_leaders()])
            directory = found[0]  # the same path on every node
        return ray.get([r.load_checkpoint.remote(directory) for r in self.ranks])[0]

    def unseen_by(self, path: str) -> list[int]:
        """Ranks whose node does not see ``path`` (a directory that is not shared across the nodes)."""
        return [r for r, seen in enumerate(ray.get([r.sees.remote(path) for r in self.ranks])) if not seen]

    def offload(self) -> bool:
        """Give the devices to the engines (colocated schedule); False where nothing moves (CPU)."""
        return all(ray.get([r.offload.remote() for r in self.ranks]))

    def onload(self) -> bool:
        """Take the devices back before training; False where nothing moves (CPU)."""
        return all(ray.get([r.onload.remote() for r in self.ranks]))

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
        if self.shared_placement is None:  # a shared group belongs to whoever made it
            remove_placement_group(self.placement_group)
