"""The resolve step: the config's names checked against the plug-in tables, and every "auto" value made
concrete for one machine, in one place.

It stands above the tables (engine and trainer backends, schedules, policy losses, estimators, data
formats, the placement layout) and below the pipeline: rayrl/config holds the schema as pure data and
imports none of them. :func:`check` is what the tables say of a config (a name none of them holds, a
trait another section contradicts), each a ConfigError naming the field; driver.py runs it before Ray
starts (:func:`load_checked`), and :func:`resolve` runs it again, so a config built in a notebook is
checked too.

``load_config`` returns the config as written; a run works on ``resolve(cfg)`` and records that in its
config.yaml, so what ran is what the file says. Resolved here:

- ``engine.backend`` auto: ``sglang`` when the machine has CUDA, else ``cpu`` (rayrl/engines/backends/).
- ``engine.dtype`` and ``trainer.compute_dtype`` auto: ``bfloat16`` where it is computed natively (GPU;
  a CPU with AVX512-BF16 or AMX), ``float32`` elsewhere (rayrl/machine.py ``compute_dtype``).
- ``engine.num_threads`` / ``trainer.num_threads`` 0: on CPU the cores are the devices, shared the way
  the schedule shares GPUs. A schedule with ``exclusive_devices`` (``sync``, ``colocated_async``) hands the
  devices over in turn, so each side gets every core while it holds them; ``async`` runs both at once,
  so each gets half. Each side's cores
  are divided among its engines / ranks. This matters under Ray: an actor starts with
  ``OMP_NUM_THREADS=1``, so torch would otherwise use one core.
- ``pipeline.groups_in_flight``: a schedule that does not run ahead (``sync``) runs exactly one step's
  groups (``rollout.prompts_per_step``, whatever is configured); the async schedules keep the configured
  number, or with 0 as many batches as the staleness bound lets train: (``max_staleness`` + 1) x
  ``prompts_per_step``.
- ``rollout.max_concurrent_episodes`` 0: a thread for every episode of those groups (a group counted as
  in flight but waiting for a thread ages against ``max_staleness`` without progress), plus
  ``pipeline.eval_max_concurrent`` when validation is on, spread over ``rollout.num_workers``.
- ``algorithm`` (:func:`resolve_algorithm`): ``tis_cap`` unset: the schedule's ``tis_cap`` (0 for ``sync``,
  2.0 for the async schedules, where samples can be stale), and on for a loss whose clip band is narrower
  than the engine-trainer gap (its ``narrow_band`` trait: GSPO's 3e-4 / 4e-4); the clip ranges and
  ``loss_agg`` ``auto``: what the loss's (or the estimator's) paper uses (their rows' ``clip`` and
  ``aggregation``; rayrl/rl/loss_settings.py makes them concrete, rayrl/rl/objective.py applies them);
  ``loss_agg_norm`` 0: ``rollout.max_turns`` x ``rollout.max_tokens``; ``dynamic_sampling_max_groups``
  0: 4 x ``rollout.prompts_per_step``; ``reference_path`` unset: ``model.path``.
- ``model.tokenizer_path`` unset: ``model.path``.
- ``engine.max_lora_rank`` 0 and ``engine.lora_target_modules`` empty, with ``trainer.lora`` on: the
  trainer's rank and target modules (all-linear: the seven linear projections), which the engines are
  launched to serve.

``pipeline.weight_transfer`` stays as configured: its ``auto`` depends on where each engine is placed
relative to the trainer and is decided when the engines exist (rayrl/weights/plan.py). The machine is the
driver's: on a cluster whose driver node differs from its GPU nodes, set ``engine.backend`` (and the
dtypes) explicitly (docs/multinode.md).
Values set explicitly are kept, so ``resolve(resolve(cfg)) == resolve(cfg)``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from typing import Any, Sequence

from rayrl.agents import harness_row
from rayrl.config import ConfigError, RunConfig, load_config
from rayrl.config.algorithm import LOSS_AGGREGATIONS, AlgorithmConfig
from rayrl.config.serving import EngineConfig
from rayrl.data.formats import FORMATS
from rayrl.engines.backends import BACKENDS, auto_backend, engine_backend
from rayrl.machine import Machine, compute_dtype
from rayrl.orchestration.schedules import SCHEDULES, schedule_kind
from rayrl.placement import plan_placement
from rayrl.rewards import check_reward
from rayrl.rl.advantages import advantage_estimator
from rayrl.rl.loss_settings import clip_range, default_tis_cap, loss_aggregation
from rayrl.rl.policy_losses import policy_loss
from rayrl.trainers.backend import TRAINER_BACKENDS, trainer_backend

DYNAMIC_SAMPLING_DRAWS = 4  # dynamic_sampling_max_groups when unset: this many x rollout.prompts_per_step


def load_checked(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """``load_config`` then :func:`check`: what driver.py reads before Ray starts (ConfigError naming the field)."""
    return check(load_config(path, overrides))


def check(cfg: RunConfig) -> RunConfig:
    """What the plug-in tables say of ``cfg`` (module docstring); returns ``cfg``, or raises ConfigError
    naming the field."""
    for field, name, table in (("trainer.backend", cfg.trainer.backend, TRAINER_BACKENDS),
                               ("pipeline.schedule", cfg.pipeline.schedule, SCHEDULES)):
        if name not in table:  # the Literal types hold these at load; a config built in code is checked here
            raise ConfigError(f"{field}: {name!r} is not one of {', '.join(table)}")
    _check_engine(cfg.engine)
    _check_trainer(cfg)
    _check_algorithm(cfg)
    _check_agent(cfg)
    check_reward(cfg.rollout)
    if schedule_kind(cfg.pipeline.schedule).runs_ahead:
        if 0 < cfg.pipeline.groups_in_flight < cfg.rollout.prompts_per_step:
            raise ConfigError("pipeline.groups_in_flight: must be 0 or at least rollout.prompts_per_step")
    if cfg.data.format != "auto" and cfg.data.format not in FORMATS:
        raise ConfigError(f"data.format: {cfg.data.format!r} is not one of auto, {', '.join(FORMATS)}")
    placement = cfg.placement
    if placement.mode != "none":
        plan_placement(placement.mode, placement.num_gpus, trainer_ranks=cfg.trainer.num_ranks,
                       num_engines=cfg.engine.num_engines, tp_size=cfg.engine.tp_size,
                       trainer_gpus=placement.trainer_gpus, trainer_gpu_fraction=placement.trainer_gpu_fraction)
    return cfg


def _check_engine(engine: EngineConfig) -> None:
    """``engine.backend`` names a row (or auto); what the row takes and requires."""
    if engine.backend == "auto":
        return
    if engine.backend not in BACKENDS:
        raise ConfigError(f"engine.backend: {engine.backend!r} is not one of auto, {', '.join(BACKENDS)}")
    backend = BACKENDS[engine.backend]
    if engine.weight_format == "fp16-packed" and "fp16-packed" not in backend.weight_formats:
        raise ConfigError(f"engine.weight_format: fp16-packed is the CPU engine's; {backend.name} takes "
                          "--dtype and its own quantisation flags (engine.extra_args)")
    if backend.check is not None:
        backend.check(engine)


def _check_agent(cfg: RunConfig) -> None:
    """What the built-in harness ``rollout.agent`` names reads from the other fields (a harness of your own is
    imported and checked by rayrl/preflight.py)."""
    rollout, row = cfg.rollout, harness_row(cfg.rollout.agent)
    reads_command = row is not None and row.reads_command
    if reads_command and not rollout.agent_command:
        raise ConfigError(f"rollout.agent_command: rollout.agent {rollout.agent} needs the program to run, e.g. "
                          "[python, my_agent.py]")
    if not reads_command and rollout.agent_command:
        raise ConfigError(f"rollout.agent_command: only read with rollout.agent: command (it is {rollout.agent!r})")
    ac = cfg.agentcore
    if row is None or not row.run_launcher or ac.local_agent_command:
        return
    if not ac.runtime_arn.startswith("arn:"):
        raise ConfigError(f"agentcore.runtime_arn: rollout.agent={rollout.agent} needs a runtime ARN, "
                          f"got {ac.runtime_arn!r}")
    if not ac.s3_bucket:
        raise ConfigError(f"agentcore.s3_bucket: rollout.agent={rollout.agent} needs a result bucket")


def _check_trainer(cfg: RunConfig) -> None:
    """What ``trainer.backend``'s row can do, and whether the engines can serve a LoRA policy."""
    trainer = cfg.trainer
    kind = trainer_backend(trainer.backend)
    if trainer.memory_saver_standin and not kind.memory_standin:
        raise ConfigError("trainer.memory_saver_standin: a CPU stand-in for the "
                          f"{' or '.join(_backends_with('memory_standin'))} backend only")
    if not kind.model_parallel and trainer.tp_size * trainer.pp_size * trainer.cp_size > 1:
        raise ConfigError("trainer.tp_size: tp/pp/cp sizes above 1 need trainer.backend "
                          f"{' or '.join(_backends_with('model_parallel'))}")
    if trainer.lora.enabled and not kind.trains_lora:
        raise ConfigError(f"trainer.lora: the {kind.name} backend trains full weights only (it has no LoRA "
                          f"adapters); use trainer.backend {' or '.join(_backends_with('trains_lora'))}")
    backend = BACKENDS.get(cfg.engine.backend)  # auto picks one that can
    if trainer.lora.enabled and backend is not None and not backend.serves_lora:
        raise ConfigError(f"trainer.lora: engine.backend {backend.name} cannot serve LoRA adapters; use one of "
                          f"{', '.join(b.name for b in BACKENDS.values() if b.serves_lora)} or trainer.lora.rank 0")


def _backends_with(trait: str) -> list[str]:
    """The trainer backends whose row has ``trait``."""
    return [kind.name for kind in TRAINER_BACKENDS.values() if getattr(kind, trait)]


def _check_algorithm(cfg: RunConfig) -> None:
    """The estimator and the loss name rows (or functions that import); their traits against the rest."""
    algo = cfg.algorithm
    estimator = advantage_estimator(algo.advantage_estimator)
    loss = policy_loss(algo.policy_loss)
    if algo.dual_clip_c > 0 and not loss.dual_clip:
        raise ConfigError(f"algorithm.dual_clip_c: applies to ppo_clip only; {loss.name} does not use it: set it to 0")
    for kind, field in ((loss, "algorithm.policy_loss"), (estimator, "algorithm.advantage_estimator")):
        if kind.aggregation is not None and kind.aggregation not in LOSS_AGGREGATIONS:
            raise ConfigError(f"{field}: {kind.name} declares aggregation {kind.aggregation!r}, not one of "
                              f"{', '.join(LOSS_AGGREGATIONS)}")
    clip_range(algo)  # a loss of your own that declared no band needs algorithm.clip_eps and clip_eps_high
    if cfg.rollout.group_size < 2 and estimator.grouped:
        raise ConfigError(f"rollout.group_size: {estimator.name} measures each episode against its group, so it "
                          "needs at least 2 episodes per task")
    if loss.whole_sequence and cfg.trainer.cp_size > 1:
        raise ConfigError(f"algorithm.policy_loss: {loss.name}'s sequence-level ratio needs whole sequences on a "
                          "rank; trainer.cp_size > 1 splits them")


def _engine_backend(engine: EngineConfig, machine: Machine) -> str:
    """A row of rayrl/engines/backends/'s table: ``auto`` means sglang exactly when the machine has CUDA."""
    if engine.backend != "auto":
        return engine.backend
    return auto_backend(machine.cuda)


def _cpu_threads(cfg: RunConfig, cores: int) -> tuple[int, int]:
    """(threads per engine, threads per trainer rank); counts above 0 in the config are kept."""
    cores = max(1, cores)
    exclusive = schedule_kind(cfg.pipeline.schedule).exclusive_devices
    engine_share = cores if exclusive else max(1, cores // 2)
    trainer_share = cores if exclusive else max(1, cores - engine_share)
    engine = cfg.engine.num_threads or max(1, engine_share // cfg.engine.num_engines)
    trainer = cfg.trainer.num_threads or max(1, trainer_share // cfg.trainer.num_ranks)
    return engine, trainer


def _groups_in_flight(cfg: RunConfig) -> int:
    """Task groups queued, running or complete-but-untrained that the schedule keeps at once."""
    per_step = cfg.rollout.prompts_per_step
    if not schedule_kind(cfg.pipeline.schedule).runs_ahead:
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


def resolve_algorithm(cfg: RunConfig) -> AlgorithmConfig:
    """``cfg.algorithm`` with every auto value concrete (module docstring)."""
    algo = cfg.algorithm
    tis_cap = algo.tis_cap
    if tis_cap is None:
        tis_cap = default_tis_cap(algo, schedule_kind(cfg.pipeline.schedule).tis_cap)
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
    (default: :meth:`Machine.detect`), after :func:`check`; ``cfg`` itself is not changed."""
    check(cfg)
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
        raise ValueError("capacity_warnings needs a resolved config (rayrl.resolve)")
    episodes = groups * cfg.rollout.group_size
    slots = cfg.rollout.num_workers * per_worker
    warnings = []
    if slots < episodes:
        warnings.append(f"rollout.max_concurrent_episodes={per_worker} x {cfg.rollout.num_workers} workers "
                        f"run fewer episodes than the {groups} groups in flight hold ({episodes}): the rest "
                        "wait for a worker thread")
    row = harness_row(cfg.rollout.agent)
    uses_sandboxes = row is None or row.uses_sandboxes
    if uses_sandboxes and cfg.sandbox_pool.max_size < min(slots, episodes):
        warnings.append(f"sandbox_pool.max_size={cfg.sandbox_pool.max_size} is below the "
                        f"{min(slots, episodes)} episodes in flight: the rest wait for a sandbox "
                        "(up to sandbox_pool.acquire_timeout_s)")
    return warnings
