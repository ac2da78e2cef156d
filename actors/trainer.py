"""TrainerGroup: trainer ranks in one placement group, joined by torch.distributed.

Each rank is a Ray actor over ``rayrl.trainers.torch_backend.TorchTrainer`` (gloo on CPU, NCCL on GPU).
The group plans a batch's updates once for every rank (``rayrl.rl.updates.plan_updates``: which samples
train, cut into mini-batches, each sharded over the data-parallel replicas balanced by tokens, with the
mini-batch's global sizes that the loss is normalised by; with Megatron's tensor/pipeline/context
parallelism the ranks of one replica train the same samples) and sends every rank its part, so
gradients are all-reduced over the whole mini-batch and every replica ends each step with identical
weights.

New weights reach the engines from the ranks that rayrl/weights/plan.py picks (``connect_weights``
once, then ``push_weights`` after each step): every rank holds one sender or none, and never asks
which transport it is.

Every call the group makes to its ranks goes through :meth:`TrainerGroup.gather`, whatever the phase
(train, onload, offload, weight push, checkpoint, ...): a rank that died (killed, its node lost) there
becomes a :class:`TrainerFailure` naming the phase and the cause, with the policy version of every
rank still alive, so the run stops the same way in every phase (rayrl/orchestration/run_checkpoint.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.rank_stacks import answer_stacks_signal, stacks_to_log
from rayrl.checkpoint import CheckpointStore
from rayrl.config import AlgorithmConfig, TrainerConfig
from rayrl.orchestration.part_failures import TrainerFailure
from rayrl.ports import free_port
from rayrl.rl.shard import replica_leads
from rayrl.rl.updates import UpdatePlan, plan_updates
from rayrl.trainers.backend import TrainerBackend, trainer_backend
from rayrl.trainers.saver_preload import preload_env
from rayrl.types import Sample
from rayrl.weights.owners import sweep_quietly
from rayrl.weights.plan import RankPlace, WeightPlan, make_sender

logger = logging.getLogger("rayrl.trainer")

# how long ranks in a collective (or a process-group meeting: MEET_TIMEOUT_S, 45 s) get to fail on their own
# once a peer has died, before they are killed
FAILURE_GRACE_S = 60.0
ALIVE_TIMEOUT_S = 30.0  # how long a rank gets to answer "are you alive" after a failure


def _cause(err: BaseException) -> str:
    """One line: the error's type and first line (a RayTaskError's: what the rank raised)."""
    cause = getattr(err, "cause", None) or err
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"


@ray.remote(num_cpus=1)
class TrainerRank:
    """One rank of the trainer."""

    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world_size: int, seed: int,
                 algorithm: Optional[AlgorithmConfig] = None) -> None:
        sweep_quietly()  # weight buffers of killed processes on this node (rayrl/weights/shm.py)
        answer_stacks_signal()  # where a rank that never answers was stuck (TrainerGroup.gather)
        self.args = (model_path, cfg, rank, world_size, seed)
        self.algorithm = algorithm
        self.trainer: Optional[TrainerBackend] = None  # the backend, called only through its protocol
        self.sender: Any = None  # this rank's weight sender (rayrl/weights/plan.py), or None
        self.world: Any = None  # rayrl.trainers.process_groups.TrainerWorld (several ranks, or Megatron)
        self._loop: asyncio.AbstractEventLoop | None = None  # one loop for the sender's HTTP sessions

    def master_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port("")  # the other ranks reach it on any interface

    def setup(self, master_addr: str, master_port: int) -> int:
        import torch

        from rayrl.engines.backends.sglang import NCCL_ENV
        from rayrl.trainers.process_groups import TrainerWorld

        model_path, cfg, rank, world_size, seed = self.args
        kind = trainer_backend(cfg.backend)
        os.environ.update(NCCL_ENV)  # as SGLang's engines have it (engines.backends.sglang), before any NCCL use
        if world_size > 1 or kind.model_parallel:
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
            # logical GPUs (ray.init(num_gpus=...) on a CPU machine) have ids but no CUDA: gloo then. On NCCL
            # the groups are released while the trainer is offloaded (rayrl/trainers/process_groups.py)
            backend = "nccl" if ray.get_gpu_ids() and torch.cuda.is_available() else "gloo"
            self.world = TrainerWorld(rank, world_size, backend, master_addr, master_port).start()
        # Megatron's raises MegatronUnavailable naming what is missing (packages, CUDA)
        self.trainer = kind.backend_class()(model_path, cfg, algorithm=self.algorithm, rank=rank,
                                            world_size=world_size, seed=seed, **dict(kind.extra_kwargs))
        return rank

    def train_step(self, samples: list[Sample], advantages: list[Any], plan: UpdatePlan) -> dict[str, Any]:
        """One step; a rank whose step raised (a collective whose peer died, its own error) leaves its process
        groups before it answers, so no peer stays blocked on it in a collective (TrainerWorld.leave)."""
        try:
            return self.trainer.train_step(samples, advantages, plan)
        except Exception as err:
            if self.world is not None:
                try:
                    self.world.leave(f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
                except Exception as left:  # the step's own error is the one to report
                    logger.warning("rank %d: could not leave its process groups: %s", self.args[2], left)
            raise

    def export_weights(self, root: str, version: int, dtype: str) -> str:
        import torch

        from rayrl.weights.files import write_weights

        # Megatron: every rank must drain the export (it gathers over TP/PP); only rank 0 writes
        state = {name: t.detach().cpu() for name, t in self.trainer.named_weights(getattr(torch, dtype))}
        if self.args[2] != 0:
            return ""
        return str(write_weights(state, Path(root), version))

    def export_lora(self, directory: str, merged: bool) -> list[str]:
        """The final adapter in PEFT's format under ``directory``/adapter and, with ``merged``, the merged HF
        model under ``directory``/merged (torch backend with trainer.lora; written on this rank's node)."""
        out = [str(self.trainer.export_adapter(Path(directory) / "adapter"))]
        if merged:
            out.append(str(self.trainer.export_merged(Path(directory) / "merged")))
        return out

    def _run(self, coro: Any) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def place(self) -> dict[str, Any]:
        """Where this rank runs (for the weight plan and the layout checks)."""
        return {"rank": self.args[2], "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def connect_weights(self, plan: WeightPlan, disk_root: str, timeout_s: float) -> bool:
        """Build (and connect) the sender ``plan`` gives this rank, replacing any previous one; a rank
        that feeds no engine holds none. Returns whether this rank sends."""
        import torch

        self.close_weights()
        cfg = self.args[1]
        cuda = torch.cuda.is_available()
        gpus = ray.get_gpu_ids()  # on CPU, a logical GPU: marked on this rank's handle payloads
        store = None if self.world is None else torch.distributed.PrefixStore("rayrl-weights", self.world.store)
        self.sender = make_sender(plan, self.args[2], bucket_bytes=cfg.weight_bucket_mb * 1024 * 1024,
                                  timeout_s=timeout_s, master_address=ray.util.get_node_ip_address(),
                                  disk_root=disk_root, cuda=cuda, store=store,
                                  gpu_id=str(int(gpus[0])) if gpus and not cuda else None,
                                  adapter_config=self.trainer.adapter_config() if cfg.lora.enabled else None)
        if self.sender is not None:
            self._run(self.sender.connect())
        return self.sender is not None

    def push_weights(self, dtype: str) -> dict[str, Any] | None:
        """Send the current weights, labelled with the policy version this rank holds, to this rank's
        engines. Megatron ranks drain the gathered export whether or not they send (it runs collectives).
        Returns the transfer figures."""
        import torch

        weights = self.trainer.named_weights(getattr(torch, dtype))
        if self.sender is None:
            if trainer_backend(self.args[1].backend).model_parallel:  # every rank takes part in the gather
                for _ in weights:
                    pass
            return None
        return self._run(self.sender.send(weights, self.trainer.policy_version)).as_dict()

    def close_weights(self) -> None:
        """Leave what the sender made (a broadcast group; engines that are gone are skipped)."""
        sender, self.sender = self.sender, None
        if sender is not None:
            self._run(sender.close())

    def save_checkpoint(self, directory: str, whole: bool = False) -> None:
        """This rank's checkpoint files; ``whole``: the whole checkpoint, written as rank 0's file (after
        a rank failure, from a surviving data-parallel rank)."""
        self.trainer.save_checkpoint(directory, as_rank=0 if whole else None)

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
        """Lend the GPU: NCCL groups released, then the memory (rayrl/trainers/process_groups.py)."""
        from rayrl.trainers.process_groups import offload_rank

        return offload_rank(self.world, self.trainer)

    def onload(self, groups: bool = True) -> bool:
        """Take the GPU back: the memory, then the process groups. ``groups=False``: the memory only (a
        surviving rank that writes the checkpoint after another died: making the groups again is a
        meeting of every rank, which the dead one never joins)."""
        from rayrl.trainers.process_groups import onload_rank

        return onload_rank(self.world if groups else None, self.trainer)


class TrainerGroup:
    """Driver-side handle over the trainer ranks."""

    def __init__(
        self,
        cfg: TrainerConfig,
        model_path: str,
        seed: int = 0,
        name_prefix: str = "rayrl",
        placement: Any = None,
        algorithm: Optional[AlgorithmConfig] = None,
    ) -> None:
        """``placement`` (actors.placement_group.SharedPlacement): ranks go to the bundles it plans (shared
        with the engines when colocated); without it the group makes a placement group of its own.
        ``algorithm``: what the ranks optimise (default: GRPO's PPO-clip)."""
        self.cfg = cfg
        self.algorithm = algorithm if algorithm is not None else AlgorithmConfig()
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
        preload = preload_env(cfg.memory_saver)  # ranks on a GPU start with the saver's hook (saver_preload.py)
        for opts in options:
            if preload and opts.get("num_gpus"):
                opts["runtime_env"] = {"env_vars": preload}
        self.processes: dict[int, tuple[str, int]] = {}  # rank -> (node id, pid), once they are set up
        self.ranks = [
            TrainerRank.options(name=f"{name_prefix}-trainer-{r}", **options[r]).remote(
                model_path, cfg, r, cfg.num_ranks, seed, self.algorithm
            )
            for r in range(cfg.num_ranks)
        ]
        # through gather, as every call: a rank lost now is a TrainerFailure ("start"), not a raw Ray error
        addr, port = self.gather("start", [self.ranks[0].master_address.remote()], ranks=[0])[0]
        self.gather("start", [r.setup.remote(addr, port) for r in self.ranks], grace_s=FAILURE_GRACE_S)
        # node and pid of every rank, to ask one that stops answering for its stacks (actors/rank_stacks.py)
        self.processes = {int(f["rank"]): (str(f["node_id"]), int(f["pid"])) for f in self._call("start", "place")}

    # -- every call to the ranks -------------------------------------------------------------------

    def gather(self, phase: str, refs: Sequence[Any], ranks: Optional[Sequence[int]] = None,
               timeout_s: Optional[float] = None, grace_s: Optional[float] = None,
               raised_fails: bool = True) -> list[Any]:
        """The answers of ``ranks`` (default: all) to one call each (``refs``, in that order).

        A rank that died (RayActorError: killed, its node lost) raises :class:`TrainerFailure` for
        ``phase`` once every other rank has answered; with ``grace_s`` (a collective: the others may be
        stuck waiting for the dead one) those still running after ``grace_s`` are killed instead. A rank
        that raised is a failure too, unless ``raised_fails`` is False: then the first such error is
        raised as it is (a weight push that an engine refused is the weight sync's business). Past
        ``timeout_s`` without a failure, ray's GetTimeoutError.
        """
        ranks = list(range(len(self.ranks))) if ranks is None else list(ranks)
        index = {ref: r for r, ref in zip(ranks, refs)}
        results: dict[int, Any] = {}
        died: dict[int, str] = {}
        raised: dict[int, BaseException] = {}
        pending = list(refs)
        end = None if timeout_s is None else time.monotonic() + timeout_s
        grace_end = None
        while pending:
            ends = [t for t in (end, grace_end) if t is not None]
            wait = None if not ends else max(0.0, min(ends) - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait)
            if not ready:
                break
            r = index[ready[0]]
            try:
                results[r] = ray.get(ready[0])
            except ray.exceptions.RayActorError as err:  # the rank's process is gone
                died[r] = _cause(err)
            except Exception as err:  # RayTaskError: it raised (a collective whose peer died, ...)
                raised[r] = err
            if (died or (raised and raised_fails)) and grace_s is not None and grace_end is None:
                grace_end = time.monotonic() + grace_s
        if died or (raised and raised_fails):
            # the dead first: theirs is the cause, the others' errors follow from it
            errors = {**dict(sorted(died.items())), **{r: _cause(e) for r, e in sorted(raised.items())}}
            for ref in pending:
                r = index[ref]
                if grace_end is not None:
                    errors[r] = (f"no answer {grace_s:.0f} s after another rank failed; "
                                 f"{stacks_to_log(*self.processes.get(r, (None, None)))}; killed")
                    ray.kill(self.ranks[r])
            raise TrainerFailure(phase, errors, self._survivors(exclude=set(died)))
        if raised:
            raise next(iter(raised.values()))
        if pending:
            silent = sorted(index[ref] for ref in pending)
            raise ray.exceptions.GetTimeoutError(f"trainer {phase}: no answer from ranks {silent} within "
                                                 f"{timeout_s:.0f} s")
        return [results[r] for r in ranks]

    def _call(self, phase: str, method: str, *args: Any, ranks: Optional[Sequence[int]] = None,
              timeout_s: Optional[float] = None) -> list[Any]:
        """``method(*args)`` on ``ranks`` (default: all), through :meth:`gather`."""
        ranks = list(range(len(self.ranks))) if ranks is None else list(ranks)
        return self.gather(phase, [getattr(self.ranks[r], method).remote(*args) for r in ranks], ranks,
                           timeout_s=timeout_s)

    def _survivors(self, exclude: set[int]) -> dict[int, int]:
        """rank -> policy version of every rank (not in ``exclude``) that answers within ALIVE_TIMEOUT_S."""
        ranks = [r for r in range(len(self.ranks)) if r not in exclude]
        refs = {self.ranks[r].policy_version.remote(): r for r in ranks}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=ALIVE_TIMEOUT_S)
        alive = {}
        for ref in ready:
            try:
                alive[refs[ref]] = int(ray.get(ref))
            except Exception:  # dead too, or it never set up
                pass
        return alive

    @property
    def full_state_on_every_rank(self) -> bool:
        """Whether one rank's files are a whole checkpoint: the torch backend is data parallel only (every
        rank holds the weights and the optimizer state); Megatron shards them over its ranks."""
        return trainer_backend(self.cfg.backend).full_state_on_every_rank

    # -- the phases ------------------------------------------------------------------------------

    def train(self, samples: list[Sample], advantages: Sequence[Any]) -> dict[str, Any]:
        """Train the batch on all ranks (its optimizer steps: rayrl/rl/updates.py); returns rank 0's
        metrics, with ``trained_samples`` and ``trained_tokens`` summed over the replicas (one rank each)
        and ``train_time_s`` the slowest rank's. ``advantages``: per sample, a float or an array over its
        response tokens.

        Raises TrainerFailure when a rank dies or fails: the ranks still running get
        ``FAILURE_GRACE_S`` to notice (gloo/NCCL raise when a peer's connection drops) and are then killed.
        """
        layout = (len(self.ranks), self.cfg.tp_size, self.cfg.pp_size, self.cfg.cp_size)
        plans = plan_updates(samples, advantages, self.algorithm, world_size=layout[0], tp=layout[1], pp=layout[2],
                             cp=layout[3], num_minibatches=self.cfg.num_steps_per_rollout,
                             epochs=self.cfg.epochs_per_rollout)
        refs = [
            rank.train_step.remote([samples[i] for i in idx], [advantages[i] for i in idx], plan)
            for rank, (idx, plan) in zip(self.ranks, plans)
        ]
        results = self.gather("train", refs, grace_s=FAILURE_GRACE_S)
        metrics = dict(results[0])
        # a replica's ranks all report its shard: count each replica once
        leads = [results[r] for r in replica_leads(*layout)]
        metrics["trained_samples"] = sum(r["trained_samples"] for r in leads)
        metrics["trained_tokens"] = sum(r["trained_tokens"] for r in leads)
        metrics["train_time_s"] = max(r["train_time_s"] for r in results)
        return metrics

    def export_weights(self, root: str, version: int, dtype: str) -> str:
        ranks = range(len(self.ranks)) if trainer_backend(self.cfg.backend).model_parallel else [0]  # all gather
        return self._call("weight export", "export_weights", root, version, dtype, ranks=ranks)[0]

    def export_lora(self, directory: str, merged: bool) -> list[str]:
        """Rank 0 writes the final LoRA adapter (and the merged model when asked); returns the paths."""
        return self._call("LoRA export", "export_lora", directory, merged, ranks=[0])[0]

    def places(self, ranks: Optional[Sequence[int]] = None) -> list[RankPlace]:
        """Where each of ``ranks`` (default: all) runs: its node and, in a shared placement, its bundle."""
        ranks = list(range(len(self.ranks))) if ranks is None else list(ranks)
        found = self._call("placement", "place", ranks=ranks)
        return [RankPlace(int(f["rank"]), str(f["node_id"]), self.bundles[r] if self.bundles else None)
                for r, f in zip(ranks, found)]

    def connect_weights(self, plan: WeightPlan, disk_root: str, timeout_s: float) -> None:
        """Give every rank its sender under ``plan`` (rayrl/weights/plan.py) and connect them."""
        refs = [r.connect_weights.remote(plan, disk_root, timeout_s) for r in self.ranks]
        self.gather("weight connect", refs, timeout_s=timeout_s + 60, raised_fails=False)

    def push_weights(self, dtype: str) -> list[Any]:
        """Refs of every rank's part of one weight push, labelled with the policy version the ranks hold
        (the trainer's own count: it never comes back from the driver); ranks without a sender return at
        once, Megatron ranks drain the export. Wait for them with :meth:`gather` (``raised_fails=False``)."""
        return [r.push_weights.remote(dtype) for r in self.ranks]

    def close_weights(self) -> None:
        """Close every rank's sender; a rank that is gone (the run stopped on its failure, which said so
        once) has nothing left to close."""
        try:
            self._call("weight close", "close_weights", timeout_s=60)
        except TrainerFailure as failure:
            logger.debug("closing the weight senders: %s", failure)

    def node_leaders(self, ranks: Optional[Sequence[int]] = None) -> list[int]:
        """The lowest of ``ranks`` (default: all) on each node: who handles files for that node."""
        leaders: dict[str, int] = {}
        for p in self.places(ranks):
            leaders.setdefault(p.node_id, p.rank)
        return sorted(leaders.values())

    def save_checkpoint(self, directory: str, from_rank: Optional[int] = None,
                        store: Optional[CheckpointStore] = None, step: int = 0) -> None:
        """Every rank writes its files into ``directory`` (on its own node). ``from_rank``, after a rank
        failure: that rank alone writes the whole checkpoint as rank 0's file (data-parallel ranks hold
        replicas of the weights and optimizer state, so it restores all of them); it is given its devices
        back first (a colocated rank may be offloaded). With an S3 ``store`` one rank per node empties the
        directory first and uploads it after."""
        ranks = list(range(len(self.ranks))) if from_rank is None else [from_rank]
        leaders = self.node_leaders(ranks) if store is not None and store.s3 is not None else ranks[:0]
        if from_rank is not None:
            self._call("checkpoint", "onload", False, ranks=ranks)  # its memory; the groups need the dead
            leaders = ranks  # its staging directory may hold a failed save's files
        self._call("checkpoint", "clear_dir", directory, ranks=leaders)
        self._call("checkpoint", "save_checkpoint", directory, from_rank is not None, ranks=ranks)
        if store is not None and store.s3 is not None:
            self._call("checkpoint", "upload_checkpoint", store.location, str(store.staging_root), step,
                       directory, ranks=leaders)

    def load_checkpoint(self, directory: str, store: Optional[CheckpointStore] = None, step: int = 0) -> int:
        """Every rank loads step ``step``; with an S3 ``store`` one rank per node downloads it first."""
        if store is not None and store.s3 is not None:
            found = self._call("resume", "download_checkpoint", store.location, str(store.staging_root), step,
                               ranks=self.node_leaders())
            directory = found[0]  # the same path on every node
        return self._call("resume", "load_checkpoint", directory)[0]

    def unseen_by(self, path: str) -> list[int]:
        """Ranks whose node does not see ``path`` (a directory that is not shared across the nodes)."""
        return [r for r, seen in enumerate(self._call("start", "sees", path)) if not seen]

    def offload(self) -> bool:
        """Give the devices to the engines (colocated schedule); False where nothing moves (CPU). On NCCL
        the ranks meet to release their groups: one that died leaves the others waiting, so they get
        ``FAILURE_GRACE_S`` (they give up after MEET_TIMEOUT_S, rayrl/trainers/process_groups.py, and
        stay alive to write the checkpoint)."""
        return all(self.gather("offload", [r.offload.remote() for r in self.ranks], grace_s=FAILURE_GRACE_S))

    def onload(self) -> bool:
        """Take the devices back before training; False where nothing moves (CPU). As offload: the ranks
        meet to make their groups again."""
        return all(self.gather("onload", [r.onload.remote() for r in self.ranks], grace_s=FAILURE_GRACE_S))

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)
        if self.shared_placement is None:  # a shared group belongs to whoever made it
            remove_placement_group(self.placement_group)
