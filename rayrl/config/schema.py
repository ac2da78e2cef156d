"""The run configuration: ``RunConfig``, the rules that span sections, and the run-level sections.

The other sections live by area, each next to its checks: serving.py (model, engine, gateway,
trajectory), rollout.py (sandbox, sandbox_pool, rollout, agentcore), training.py (trainer, placement)
and algorithm.py. What holds for all of them:

Fields with a fixed set of values are ``Literal`` types, which OmegaConf enforces when it builds the
config (the error names the dotted field). Each section checks its own ranges in ``__post_init__``;
rules that span sections are in ``RunConfig.__post_init__``. So the checks run however a config is
built (OmegaConf, ``dataclasses.replace``, a constructor call in a test), and every error names
``section.field``; only the ``Literal`` choices are left to OmegaConf (a plain constructor call does not
check them). What the plug-in tables say (a backend, loss, estimator or format name; a trait another
section contradicts; the placement layout) is checked a step above, by rayrl/resolve.py ``check``: this
package imports no table.

Values that mean "auto" (0, None, ``auto``) are left as they are here: rayrl/resolve.py makes them
concrete. The comment beside each field is its documentation (docs/config.md is generated from them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from rayrl.config.algorithm import AlgorithmConfig
from rayrl.config.checks import ConfigError, at_least_one, non_negative, positive
from rayrl.config.data_sources import ReasoningGymSource, check_sources
from rayrl.config.guards import GuardsConfig
from rayrl.config.rollout import AgentCoreConfig, RolloutConfig, SandboxConfig, SandboxPoolConfig
from rayrl.config.serving import EngineConfig, GatewayConfig, ModelConfig, TrajectoryConfig
from rayrl.config.training import PlacementConfig, TrainerConfig


@dataclass
class DataFields:
    """Which field of a data file's rows is what, in the file's own names (rayrl/data/dataset.py)."""

    prompt: str = "prompt"  # the task's text, a string in every row (task.prompt; data.max_prompt_chars filters on it)
    id: str = "id"  # the task's id, when a row has it (else <file stem>-<line or index>)
    metadata: str = "metadata"  # an object handed to the agent and the reward as task.metadata, when a row has it (a
    # CSV cell holding a JSON object is parsed)
    answer: Optional[str] = None  # a field copied into task.metadata["answer"], what the built-in rewards compare
    metadata_fields: list[str] = field(default_factory=list)  # more fields copied into task.metadata under their own
    # names; ["*"]: every field not mapped above

    def __post_init__(self) -> None:
        for key in ("prompt", "id", "metadata"):
            if not getattr(self, key):
                raise ConfigError(f"data.fields.{key}: must name a field")
        if self.answer == "":
            raise ConfigError("data.fields.answer: must name a field (or be null)")


@dataclass
class DataConfig:
    """The task dataset: a data file of one row per task, its fields mapped by data.fields."""

    train_path: str = "examples/calculator/data/train.jsonl"  # training tasks: a .jsonl, .json, .csv/.tsv or .parquet
    # file, or a Hugging Face datasets save_to_disk directory (one split's)
    val_path: Optional[str] = None  # held-out tasks for validation (same format and fields)
    format: str = "auto"  # auto (by the path: a directory is a datasets directory, a file goes by its suffix), jsonl,
    # json, csv, parquet (needs pyarrow) or hf_disk (needs datasets); rayrl/data/formats.py
    fields: DataFields = field(default_factory=DataFields)  # which field of a row is the prompt, id, metadata, answer
    shuffle: bool = True  # reshuffle each epoch (seeded)
    max_prompt_chars: int = 0  # drop rows whose prompt is longer (0: keep all)
    reasoning_gym: list[ReasoningGymSource] = field(default_factory=list)  # reasoning-gym datasets to generate the
    # tasks from instead of train_path (and, with val_size, the held-out tasks instead of val_path); each entry: name,
    # size, seed, weight, config, val_size, val_seed (docs/environments.md)

    def __post_init__(self) -> None:
        if not self.format:
            raise ConfigError("data.format: must be auto or name a format (rayrl/data/formats.py)")
        check_sources(self.reasoning_gym)
        if self.reasoning_gym and self.max_prompt_chars:
            raise ConfigError("data.max_prompt_chars: filters the data file's rows; reasoning-gym tasks are sized by "
                              "their dataset's own config (data.reasoning_gym[i].config)")

    def has_val(self) -> bool:
        """Whether there are held-out tasks (a file, or reasoning-gym entries with val_size)."""
        return bool(self.val_path) or any(s.val_size for s in self.reasoning_gym)


@dataclass
class PipelineConfig:
    """How rollout and training are scheduled."""

    schedule: Literal["sync", "async", "colocated_async"] = "sync"  # sync | async | colocated_async (order of phases:
    # rayrl/orchestration/schedules.py)
    max_staleness: int = 1  # async schedules: samples from more than this many policy versions ago are dropped
    groups_in_flight: int = 0  # async schedules: task groups kept running ahead (0: (max_staleness + 1) x
    # rollout.prompts_per_step, as many batches as the staleness bound lets train)
    partial_rollout: bool = False  # colocated_async: abort generations at a weight update and continue them on the new
    # weights (False: they finish first)
    generation_wait_timeout_s: float = 600.0  # colocated_async: an LLM call waits at most this long at the gateway
    # while engines are paused
    weight_sync_timeout_s: float = 300.0  # a weight update to the engines that takes longer fails the step with a clear
    # error
    weight_transfer: Literal["auto", "disk", "tensor", "distributed"] = "auto"  # how new weights reach the engines:
    # auto | disk | tensor | distributed (auto: tensor, i.e. shared-memory handles on CPU and CUDA IPC on GPU, when
    # every engine has a trainer rank on its node (on GPU: on each of its GPUs, colocated; a tensor-parallel engine gets
    # one payload per TP rank, each from the rank on that GPU), else distributed: a gloo / NCCL broadcast;
    # rayrl/weights/plan.py)
    max_episode_retries: int = 2  # an episode whose rollout worker died is re-queued at most this many times
    max_group_reruns: int = 2  # a task whose group had too few successful episodes runs again at most this many times
    checkpoint_interval: int = 0  # save every N steps and at the end (0: only at the end; -1: never, so no --resume)
    checkpoint_dir: Optional[str] = None  # a directory or s3://bucket/prefix (boto3 config, e.g. AWS_ENDPOINT_URL_S3);
    # default runs/<exp_id>/checkpoints
    keep_checkpoints: int = 1  # keep only the newest N complete checkpoints (0: keep all); one checkpoint is the
    # weights plus AdamW's two moments, 12 bytes per parameter in float32 (1.6 GB for SmolLM2-135M)
    episode_budget: int = 0  # the run's episodes, those dynamic sampling dropped and reruns included: a group of
    # rollout.group_size episodes is queued only if the budget still has room for all of them (counted when queued, so
    # async prefetch is counted too); the step that runs out stops drawing and trains on the groups it kept (none: no
    # gradient step), and the run ends once every group paid for was taken; compares runs at equal rollout cost (0:
    # trainer.steps alone)
    eval_interval: int = 0  # validate on data.val_path before step 1 and every N steps (0: never)
    eval_tasks: int = 64  # validation tasks per evaluation (0: the whole set)
    eval_max_concurrent: int = 16  # episodes in flight during validation

    def __post_init__(self) -> None:
        positive(self, "pipeline.", "generation_wait_timeout_s", "weight_sync_timeout_s")
        if self.checkpoint_interval < -1:
            raise ConfigError("pipeline.checkpoint_interval: must be >= -1 (-1: never), "
                              f"got {self.checkpoint_interval}")
        non_negative(self, "pipeline.", "keep_checkpoints", "max_staleness",
                     "groups_in_flight", "max_episode_retries", "max_group_reruns", "eval_interval", "eval_tasks",
                     "episode_budget")
        at_least_one(self, "pipeline.", "eval_max_concurrent")
        self._check_checkpoint_dir()

    def _check_checkpoint_dir(self) -> None:
        """An s3:// location needs a bucket and boto3: caught at load rather than at the first save."""
        location = self.checkpoint_dir
        if not location or not location.startswith("s3://"):
            return
        if not location[len("s3://"):].split("/")[0]:
            raise ConfigError(f"pipeline.checkpoint_dir: {location!r} names no bucket (s3://bucket/prefix)")
        try:
            import boto3  # noqa: F401
        except ImportError:
            raise ConfigError("pipeline.checkpoint_dir: s3:// checkpoints need boto3 "
                              "(pip install 'rayrl[aws]')") from None


@dataclass
class LoggingConfig:
    """Where metrics go."""

    output_dir: str = "runs"  # runs/<exp_id>/ holds metrics.jsonl, tensorboard, plots, checkpoints
    tensorboard: bool = True  # write tensorboard event files
    wandb: bool = False  # log to Weights & Biases
    wandb_project: str = "rayrl"  # W&B project
    wandb_mode: Literal["online", "offline"] = "online"  # online | offline
    plot: bool = True  # write reward_curve.png after each step
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"  # python logging level
    inspect_episodes_per_step: int = 4  # the first N episodes of each step keep token detail (ids, masks, log-probs,
    # versions, advantages) in runs/<exp_id>/inspect/ for `python -m rayrl.inspect`; every episode keeps its turn tree;
    # 0: no inspection data (docs/inspector.md)

    def __post_init__(self) -> None:
        non_negative(self, "logging.", "inspect_episodes_per_step")


@dataclass
class RayConfig:
    """How driver.py reaches Ray."""

    address: Optional[str] = None  # None: start a local Ray (or join the job's cluster under `ray job submit`)
    num_cpus: Optional[int] = None  # logical CPUs for a local Ray (default: machine cores, at least 4)
    num_gpus: Optional[int] = None  # logical GPUs for a local Ray
    include_dashboard: bool = True  # start the dashboard with a local Ray
    dashboard_host: str = "127.0.0.1"  # loopback by default
    dashboard_port: int = 8265  # dashboard port of a local Ray


@dataclass
class RunConfig:
    """A whole experiment."""

    exp_id: str = "calculator"  # run name; outputs go to <logging.output_dir>/<exp_id>
    seed: int = 0  # seeds data order, sampling and initialisation
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    trajectory: TrajectoryConfig = field(default_factory=TrajectoryConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    sandbox_pool: SandboxPoolConfig = field(default_factory=SandboxPoolConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agentcore: AgentCoreConfig = field(default_factory=AgentCoreConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.output_dir) / self.exp_id

    def __post_init__(self) -> None:
        """The top-level fields and the rules that span sections (each section has checked itself)."""
        if self.seed < 0:
            raise ConfigError(f"seed: must be >= 0, got {self.seed!r}")
        if not self.exp_id or "/" in self.exp_id or self.exp_id in (".", ".."):
            raise ConfigError(f"exp_id: must be a plain name, got {self.exp_id!r}")
        self._check_algorithm()
        if self.rollout.judge.serve and self.placement.mode != "none":
            raise ConfigError("rollout.judge.serve: with a shared GPU placement the run does not place a judge "
                              "engine; serve the judge yourself and give its endpoint as rollout.judge.base_url")
        if self.rollout.environment and (self.data.reasoning_gym or self.data.val_path):
            raise ConfigError("rollout.environment: the environment's datasets are the tasks; drop "
                              + ("data.reasoning_gym" if self.data.reasoning_gym else "data.val_path"))
        if self.pipeline.eval_interval and not self.data.has_val() and not self.rollout.environment:
            raise ConfigError("pipeline.eval_interval: set data.val_path (or data.reasoning_gym[i].val_size) to "
                              "validate")
        if 0 < self.pipeline.episode_budget < self.rollout.group_size:
            raise ConfigError(f"pipeline.episode_budget: {self.pipeline.episode_budget} is less than one group "
                              f"(rollout.group_size {self.rollout.group_size}); groups start whole")

    def _check_algorithm(self) -> None:
        """The algorithm's needs from the other sections that no plug-in's traits decide (those: rayrl/resolve.py)."""
        algo = self.algorithm
        teacher = algo.distill_teacher
        if teacher and not teacher.startswith(("http://", "https://")) and self.placement.mode != "none":
            raise ConfigError("algorithm.distill_teacher: with a shared GPU placement the run does not place a "
                              "teacher engine; serve the teacher yourself and give its http:// URL")
