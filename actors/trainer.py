"""TrainerGroup: trainer ranks in one placement group, joined by torch.distributed.

Each rank is a Ray actor over ``rayrl.trainers.torch_backend.TorchTrainer`` (gloo on CPU, NCCL on GPU).
The group splits a batch across ranks balanced by tokens, so gradients are all-reduced over the whole
batch and every rank ends each step with identical weights.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayrl.config import TrainerConfig
from rayrl.types import Sample


@ray.remote(num_cpus=1)
class TrainerRank:
    """One rank of the trainer."""

    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world_size: int, seed: int) -> None:
        self.args = (model_path, cfg, rank, world_size, seed)
        self.trainer = None

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
            backend = "nccl" if ray.get_gpu_ids() else "gloo"
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        self.trainer = TorchTrainer(model_path, cfg, rank=rank, world_size=world_size, seed=seed)
        return rank

    def train_step(self, samples: list[Sample], advantages: list[float], global_tokens: int) -> dict[str, Any]:
        return self.trainer.train_step(samples, advantages, global_tokens)

    def export_weights(self, root: str, version: int, dtype: str) -> str:
        import torch

        from rayrl.trainers.weights import write_weights

        state = dict(self.trainer.named_weights(getattr(torch, dtype)))
        return str(write_weights(state, Path(root), version))

    def save_checkpoint(self, directory: str) -> None:
        self.trainer.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> int:
        self.trainer.load_checkpoint(directory)
        return self.trainer.policy_version

    def policy_version(self) -> int:
        return self.trainer.policy_version


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

    def __init__(self, cfg: TrainerConfig, model_path: str, seed: int = 0, name_prefix: str = "rayrl") -> None:
        self.cfg = cfg
        use_gpu = bool(ray.cluster_resources().get("GPU", 0))
        bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        self.placement_group = placement_group([bundle] * cfg.num_ranks, strategy="PACK")
        ray.get(self.placement_group.ready())
        self.ranks = [
            TrainerRank.options(
                num_gpus=1 if use_gpu else 0,
                name=f"{name_prefix}-trainer-{r}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=r
                ),
            ).remote(model_path, cfg, r, cfg.num_ranks, seed)
            for r in range(cfg.num_ranks)
        ]
        addr, port = ray.get(self.ranks[0].master_address.remote())
        ray.get([r.setup.remote(addr, port) for r in self.ranks])

    def train(self, samples: list[Sample], advantages: Sequence[float]) -> dict[str, Any]:
        """One optimizer step over the batch on all ranks; returns rank 0's metrics."""
        buckets = split_by_tokens(samples, len(self.ranks))
        global_tokens = sum(s.num_trained_tokens for s, a in zip(samples, advantages) if a != 0.0)
        refs = [
            rank.train_step.remote([samples[i] for i in idx], [float(advantages[i]) for i in idx], global_tokens)
            for rank, idx in zip(self.ranks, buckets)
        ]
        results = ray.get(refs)
        metrics = dict(results[0])
        metrics["trained_samples"] = sum(r["trained_samples"] for r in results)
        metrics["trained_tokens"] = sum(r["trained_tokens"] for r in results)
        metrics["train_time_s"] = max(r["train_time_s"] for r in results)
        return metrics

    def export_weights(self, root: str, version: int, dtype: str) -> str:
        return ray.get(self.ranks[0].export_weights.remote(root, version, dtype))

    def save_checkpoint(self, directory: str) -> None:
        ray.get([r.save_checkpoint.remote(directory) for r in self.ranks])

    def load_checkpoint(self, directory: str) -> int:
        return ray.get([r.load_checkpoint.remote(directory) for r in self.ranks])[0]

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
        remove_placement_group(self.placement_group)
