"""TrainerGroup: trainer ranks in one placement group, joined by torch.distributed.

Each rank is a Ray actor over ``rayrl.trainers.torch_backend.TorchTrainer`` (gloo on CPU, NCCL on GPU).
The group splits a batch across ranks balanced by tokens, so gradients are all-reduced over the whole
batch and every rank ends each step with identical weights.

New weights reach the engines from rank 0 either through a file (``export_weights``) or without disk
(``open_weight_sender`` then ``push_weights``: CUDA IPC handles or a broadcast group, see
rayrl/trainers/weight_transfer.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayrl.config import TrainerConfig
from rayrl.types import Sample

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
        self.args = (model_path, cfg, rank, world_size, seed)
        self.trainer = None
        self.sender: Any = None  # rank 0's weight sender (pipeline.weight_transfer tensor / distributed)
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

        from rayrl.trainers.weights import write_weights

        # Megatron: every rank must drain the export (it gathers over TP/PP); only rank 0 writes
        state = {name: t.detach().cpu() for name, t in self.trainer.named_weights(getattr(torch, dtype))}
        if self.args[2] != 0:
            return ""
        return str(write_weights(state, Path(root), version))

    def _run(self, coro: Any) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def open_weight_sender(self, kind: str, engine_urls: list[str], engine_tp_size: int, timeout_s: float) -> bool:
        """Rank 0: build the sender for ``kind`` (tensor | distributed) and, for a broadcast group, form
        it with every engine rank. Other ranks hold none (they only take part in Megatron's export)."""
        from rayrl.trainers.weight_transfer import DistributedWeightSender, sender_for

        self.close_weight_sender()
        if self.args[2] != 0:
            return False
        self.sender = sender_for(self.args[1], engine_urls, colocated=kind == "tensor", engine_tp_size=engine_tp_size,
                                 master_address=ray.util.get_node_ip_address(), timeout_s=timeout_s)
        if isinstance(self.sender, DistributedWeightSender):
            self._run(self.sender.connect())
        return True

    def push_weights(self, version: int, dtype: str) -> dict[str, Any] | None:
        """Send the current weights to the engines as ``version`` (rank 0; Megatron ranks drain the
        export with it). Returns rank 0's transfer figures."""
        import torch

        if self.sender is None:
            if self.args[1].backend == "megatron":
                for _ in self.trainer.named_weights(getattr(torch, dtype)):
                    pass
            return None
        stats = self._run(self.sender.send(self.trainer.named_weights(getattr(torch, dtype)), version))
        return {"bytes": stats.bytes, "seconds": stats.seconds, "buckets": stats.buckets, "gb_per_s": stats.gb_per_s}

    def close_weight_sender(self) -> None:
        """Tear down the broadcast group (engines that are gone are skipped)."""
        from rayrl.trainers.weight_transfer import DistributedWeightSender

        sender, self.sender = self.sender, None
        if isinstance(sender, DistributedWeightSender):
            self._run(sender.close())

    def save_checkpoint(self, directory: str) -> None:
        self.trainer.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> int:
        self.trainer.load_checkpoint(directory)
        return self.trainer.policy_version

    def policy_version(self) -> int:
        return self.trainer.policy_version

    def offload(self) -> bool:
        return self.trainer.offload()

    def onload(self) -> bool:
        return self.trainer.onload()


def split_by_tokens(samples: Sequence[Sample], ranks: int) -> list[list[int]]:
    """Indices per rank, greedily balancing trained tokens (longest first)."""
    buckets: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for i in sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens)):
        r = loads.index(min(loads))
        buckets[r].append(i)
        loads[r] += len(samples[i].tokens)
    return buckets


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
        """``placement`` (actors.placement.SharedPlacement): ranks go to the bundles it plans (shared with
        the engines when colocated); without it the group makes a placement group of its own."""
        self.cfg = cfg
        self.shared_placement = placement
        if placement is not None:
            self.placement_group = placement.group
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
        """One optimizer step over the batch on all ranks; returns rank 0's metrics.

        Raises TrainerFailure when a rank dies or fails: the ranks still running get
        ``FAILURE_GRACE_S`` to notice (gloo/NCCL raise when a peer's connection drops) and are then killed.
        """
        buckets = split_by_tokens(samples, len(self.ranks))
        global_tokens = sum(s.num_trained_tokens for s, a in zip(samples, advantages) if a != 0.0)
        refs = [
            rank.train_step.remote([samples[i] for i in idx], [float(advantages[i]) for i in idx], global_tokens)
            for rank, idx in zip(self.ranks, buckets)
        ]
        results = self._gather(refs)
        metrics = dict(results[0])
        metrics["trained_samples"] = sum(r["trained_samples"] for r in results)
        metrics["trained_tokens"] = sum(r["trained_tokens"] for r in results)
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

    def open_weight_sender(self, kind: str, engine_urls: Sequence[str], engine_tp_size: int, timeout_s: float) -> None:
        """Make rank 0 ready to send weights without disk (``kind``: tensor | distributed)."""
        ray.get([r.open_weight_sender.remote(kind, list(engine_urls), engine_tp_size, timeout_s) for r in self.ranks],
                timeout=timeout_s + 60)

    def push_weights(self, version: int, dtype: str) -> list[Any]:
        """Refs of every rank's part of one weight push (Megatron: all ranks; torch: rank 0)."""
        ranks = self.ranks if self.cfg.backend == "megatron" else self.ranks[:1]
        return [r.push_weights.remote(version, dtype) for r in ranks]

    def close_weight_sender(self) -> None:
        ray.get(self.ranks[0].close_weight_sender.remote(), timeout=60)

    def save_checkpoint(self, directory: str, only_rank0: bool = False) -> None:
        """Every rank writes its file; ``only_rank0`` after a rank failure (ranks hold replicas of the
        optimizer state, so rank 0's file restores all of them)."""
        ranks = self.ranks[:1] if only_rank0 else self.ranks
        ray.get([r.save_checkpoint.remote(directory) for r in ranks])

    def load_checkpoint(self, directory: str) -> int:
        return ray.get([r.load_checkpoint.remote(directory) for r in self.ranks])[0]

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
