"""``resolve``: every "auto" value of a config made concrete for one machine, in one place.

``load_config`` returns the config as written; a run works on ``resolve(cfg)`` and records that in its
config.yaml, so what ran is what the file says. Resolved here:

- ``engine.backend`` auto: ``sglang`` when the machine has CUDA, else ``cpu`` (rayrl/engines/backends/).
- ``engine.dtype`` and ``trainer.compute_dtype`` auto: ``bfloat16`` where it is computed natively (GPU;
  a CPU with AVX512-BF16 or AMX), ``float32`` elsewhere (:func:`compute_dtype`).
- ``engine.num_threads`` / ``trainer.num_threads`` 0: on CPU the cores are the devices, shared the way
  the schedule shares GPUs. ``sync`` and ``colocated_async`` hand the devices over in turn, so each side
  gets every core while it holds them; ``async`` runs both at once, so each gets half. Each side's cores
  are divided among its engines / ranks. This matters under Ray: an actor starts with
  ``OMP_NUM_THREADS=1``, so torch would otherwise use one core.
- ``pipeline.groups_in_flight``: ``sync`` runs exactly one step's groups (``rollout.prompts_per_step``,
  whatever is configured); the async schedules keep the configured number, or with 0 as many batches as
  the staleness bound lets train: (``max_staleness`` + 1) x ``prompts_per_step``.
- ``rollout.max_concurrent_episodes`` 0: a thread for every episode of those groups (a group counted as
  in flight but waiting for a thread ages against ``max_staleness`` without progress), plus
  ``pipeline.eval_max_concurrent`` when validation is on, spread over ``rollout.num_workers``.
- ``algorithm`` (:func:`resolve_algorithm`): ``tis_cap`` unset: 0 (off) for ``sync``,
  :data:`DEFAULT_ASYNC_TIS_CAP` for the async schedules, where samples can be stale, and for a loss whose
  clip band is narrower than the engine-trainer gap (:data:`NARROW_BAND_LOSSES`: GSPO's 3e-4 / 4e-4); the
  clip ranges and ``loss_agg`` ``auto``: what the loss's (or the estimator's) paper uses (:data:`CLIP_DEFAULTS`);
  ``loss_agg_norm`` 0: ``rollout.max_turns`` x ``rollout.max_tokens``; ``dynamic_sampling_max_groups``
  0: 4 x ``rollout.prompts_per_step``; ``reference_path`` unset: ``model.path``.
- ``model.tokenizer_path`` unset: ``model.path``.
- ``engine.max_lora_rank`` 0 and ``engine.lora_target_modules`` empty, with ``trainer.lora`` on: the
  trainer's rank and target modules (all-linear: the seven linear projections), which the engines are
  launched to serve.

``pipeline.weight_transfer`` stays as configured: its ``auto`` depends on where each engine is placed
relative to the trainer and is decided when the engines exist (rayrl/weights/routes.py). The machine is the
driver's: on a cluster whose driver node differs from its GPU nodes, set ``engine.backend`` (and the
dtypes) explicitly (docs/multinode.md).
Values set explicitly are kept, so ``resolve(resolve(cfg)) == resolve(cfg)``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from rayrl.config.algorithm import AlgorithmConfig
from rayrl.config.schema import RunConfig
from rayrl.config.serving import EngineConfig

DEFAULT_ASYNC_TIS_CAP = 2.0  # algorithm.tis_cap when unset and the schedule is async or colocated_async
# Losses whose clip band is narrower than the engine-trainer log-prob gap, so their ratio must be taken against the
# trainer's own log-probs (tis_cap > 0; the gap goes into the TIS weight instead). Against the engine's, GSPO's
# 3e-4 band clipped 60% of a step's sequences before any update (docs/results/algorithms.md, 2026-11-27: a
# per-token gap of 2.5e-3 mean after the first weight update, fp16-packed engine against the float32 trainer).
NARROW_BAND_LOSSES = frozenset({"gspo"})
# (clip_eps, clip_eps_high) when unset, by policy loss: PPO with DAPO's clip-higher; GSPO's paper
# (sequence-level ratios sit much closer to 1); CISPO with no lower bound and slime's wide upper bound
CLIP_DEFAULTS = {"ppo_clip": (0.2, 0.28), "gspo": (3e-4, 4e-4), "cispo": (1.0, 4.0)}
DYNAMIC_SAMPLING_DRAWS = 4  # dynamic_sampling_max_groups when unset: this many x rollout.prompts_per_step
EXCLUSIVE_SCHEDULES = ("sync", "colocated_async")  # rollout and training take the devices in turn


@dataclass(frozen=True)
class Machine:
    """What resolution depends on: the cores this process may use, whether CUDA is present, and whether
    the CPU computes bfloat16 natively (AVX512-BF16 or AMX; elsewhere torch emulates it, and a batched
    matmul in bf16 runs at a fraction of float32's speed: 2.1x slower engine decode at batch 8 on an AVX2
    EPYC, measured with bench/engine_throughput.py; 1.6-10x slower matmuls on an AVX512 Xeon without
    AVX512-BF16, :func:`cpu_has_native_bf16`)."""

    cores: int
    cuda: bool
    native_bf16: bool = False

    @classmethod
    def detect(cls) -> Machine:
        """This process's machine: its CPU affinity (which containers and taskset narrow) and
        ``torch.cuda.is_available()`` (False without torch)."""
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        try:
            import torch
        except ImportError:
            return cls(cores=cores, cuda=False)
        return cls(cores=cores, cuda=bool(torch.cuda.is_available()), native_bf16=cpu_has_native_bf16())


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively. On x86: AVX512-BF16 or AMX, asked of torch's own CPU
    checks (or, where this torch lacks them, the kernel's CPU flags). oneDNN's check alone
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) also says yes on any AVX512 CPU, where bf16 is
    emulated: on an Intel Xeon with AVX512 but neither (2026-11-27) a bf16 ``F.linear`` of SmolLM2's
    gate/up shape ran 1.6x slower than float32 at 8 rows and 5-10x slower at 64-512, so ``auto`` must not
    pick it there. Elsewhere (Arm) oneDNN's check stands."""
    import platform

    import torch

    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        cpu = getattr(torch, "cpu", None)
        checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        if all(callable(check) for check in checks):
            return any(bool(check()) for check in checks)
        return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the Linux kernel lists them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compute_dtype(requested: str, cuda: bool, native_bf16: bool) -> str:
    """``auto`` made concrete for a device: bfloat16 where it is computed natively, float32 elsewhere.
    The rule for ``engine.dtype`` and ``trainer.compute_dtype`` (one home)."""
    if requested != "auto":
        return requested
    return "bfloat16" if cuda or native_bf16 else "float32"


def _engine_backend(engine: EngineConfig, machine: Machine) -> str:
    """A row of rayrl/engines/backends/'s table: ``auto`` means sglang exactly when the machine has CUDA."""
    from rayrl.engines.backends import auto_backend  # not at import: rayrl.config imports no rayrl module

    if engine.backend != "auto":
        return engine.backend
    return auto_backend(machine.cuda)


def _cpu_threads(cfg: RunConfig, cores: int) -> tuple[int, int]:
    """(threads per engine, threads per trainer rank); counts above 0 in the config are kept."""
    cores = max(1, cores)
    exclusive = cfg.pipeline.schedule in EXCLUSIVE_SCHEDULES
    engine_share = cores if exclusive else max(1, cores // 2)
    trainer_share = cores if exclusive else max(1, cores - engine_share)
    engine = cfg.engine.num_threads or max(1, engine_share // cfg.engine.num_engines)
    trainer = cfg.trainer.num_threads or max(1, trainer_share // cfg.trainer.num_ranks)
    return engine, trainer


def _groups_in_flight(cfg: RunConfig) -> int:
    """Task groups queued, running or complete-but-untrained that the schedule keeps at once."""
    per_step = cfg.rollout.prompts_per_step
    if cfg.pipeline.schedule == "sync":
        return per_step
    return cfg.pipeline.groups_in_flight or (cfg.pipeline.max_staleness + 1) * per_step


def _episodes_per_worker(cfg: RunConfig, groups: int) -> int:
    """Episode threads per rollout worker for ``groups`` in flight (a configured count is kept)."""
    if cfg.rollout.max_concurrent_episodes > 0:
        return cfg.rollout.max_concurrent_episodes
    episodes = groups * cfg.rollout.group_size
    if cfg.pipeline.eval_interval > 0:  # validation's episodes can start while the last groups still run
        episodes += cfg.pipeline.eval_max_concurrent
    return max(1, math.ceil(episodes / cfg.rollout.num_workers))


def loss_aggregation(algo: AlgorithmConfig) -> str:
    """``loss_agg`` made concrete: as set, else what the loss's or the estimator's paper uses."""
    if algo.loss_agg != "auto":
        return algo.loss_agg
    if algo.policy_loss == "gspo":
        return "seq_mean_token_mean"
    if algo.advantage_estimator == "dr_grpo":
        return "seq_mean_token_sum_norm"
    return "token_mean"


def clip_range(algo: AlgorithmConfig) -> tuple[float, float]:
    """``(clip_eps, clip_eps_high)``: as set, else :data:`CLIP_DEFAULTS` for the loss (a loss of your own
    gets ppo_clip's)."""
    low, high = CLIP_DEFAULTS.get(algo.policy_loss, CLIP_DEFAULTS["ppo_clip"])
    return (low if algo.clip_eps is None else algo.clip_eps, high if algo.clip_eps_high is None else algo.clip_eps_high)


def default_tis_cap(algo: AlgorithmConfig, schedule: str) -> float:
    """``algorithm.tis_cap`` when unset (module docstring): on where samples can be stale or the loss's band is
    narrower than the engine-trainer gap, else off."""
    on = schedule != "sync" or algo.policy_loss in NARROW_BAND_LOSSES
    return DEFAULT_ASYNC_TIS_CAP if on else 0.0


def resolve_algorithm(cfg: RunConfig) -> AlgorithmConfig:
    """``cfg.algorithm`` with every auto value concrete (module docstring)."""
    algo = cfg.algorithm
    tis_cap = algo.tis_cap
    if tis_cap is None:
        tis_cap = default_tis_cap(algo, cfg.pipeline.schedule)
    low, high = clip_range(algo)
    return dataclasses.replace(
        algo, tis_cap=tis_cap, clip_eps=low, clip_eps_high=high, loss_agg=loss_aggregation(algo),
        loss_agg_norm=algo.loss_agg_norm or cfg.rollout.max_turns * cfg.rollout.max_tokens,
        dynamic_sampling_max_groups=algo.dynamic_sampling_max_groups
        or DYNAMIC_SAMPLING_DRAWS * cfg.rollout.prompts_per_step,
        reference_path=algo.reference_path or cfg.model.path,
    )


LINEAR_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _engine_lora(cfg: RunConfig) -> dict[str, Any]:
    """``engine.max_lora_rank`` and ``engine.lora_target_modules`` from ``trainer.lora`` (kept when set)."""
    lora = cfg.trainer.lora
    if not lora.enabled:
        return {}
    targets = LINEAR_PROJECTIONS if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules)
    return {"max_lora_rank": cfg.engine.max_lora_rank or lora.rank,
            "lora_target_modules": list(cfg.engine.lora_target_modules) or targets}


def resolve(cfg: RunConfig, machine: Machine | None = None) -> RunConfig:
    """A copy of ``cfg`` with every auto value concrete (the module docstring lists them) for ``machine``
    (default: :meth:`Machine.detect`); ``cfg`` itself is not changed."""
    from rayrl.engines.backends import engine_backend  # not at import: rayrl.config imports no rayrl module

    machine = machine if machine is not None else Machine.detect()
    cfg = copy.deepcopy(cfg)
    engine_threads, trainer_threads = _cpu_threads(cfg, machine.cores)
    groups = _groups_in_flight(cfg)
    backend = _engine_backend(cfg.engine, machine)
    engine_on_gpu = engine_backend(backend).on_gpu
    replace = dataclasses.replace
    return replace(
        cfg,
        model=replace(cfg.model, tokenizer_path=cfg.model.tokenizer_path or cfg.model.path),
        engine=replace(cfg.engine, backend=backend, num_threads=engine_threads,
                       dtype=compute_dtype(cfg.engine.dtype, engine_on_gpu, machine.native_bf16),
                       **_engine_lora(cfg)),
        trainer=replace(cfg.trainer, num_threads=trainer_threads,
                        compute_dtype=compute_dtype(cfg.trainer.compute_dtype, machine.cuda, machine.native_bf16)),
        algorithm=resolve_algorithm(cfg),
        pipeline=replace(cfg.pipeline, groups_in_flight=groups),
        rollout=replace(cfg.rollout, max_concurrent_episodes=_episodes_per_worker(cfg, groups)),
    )


def capacity_warnings(cfg: RunConfig) -> list[str]:
    """What makes some episodes of the groups in flight wait, when explicit limits are below them.

    ``cfg`` must be resolved (:func:`resolve`): the counts it compares are the resolved ones.
    """
    groups, per_worker = cfg.pipeline.groups_in_flight, cfg.rollout.max_concurrent_episodes
    if groups < 1 or per_worker < 1:
        raise ValueError("capacity_warnings needs a resolved config (rayrl.config.resolve)")
    episodes = groups * cfg.rollout.group_size
    slots = cfg.rollout.num_workers * per_worker
    warnings = []
    if slots < episodes:
        warnings.append(f"rollout.max_concurrent_episodes={per_worker} x {cfg.rollout.num_workers} workers "
                        f"run fewer episodes than the {groups} groups in flight hold ({episodes}): the rest "
                        "wait for a worker thread")
    if cfg.rollout.agent != "agentcore" and cfg.sandbox_pool.max_size < min(slots, episodes):
        warnings.append(f"sandbox_pool.max_size={cfg.sandbox_pool.max_size} is below the "
                        f"{min(slots, episodes)} episodes in flight: the rest wait for a sandbox "
                        "(up to sandbox_pool.acquire_timeout_s)")
    return warnings
