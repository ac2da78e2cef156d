"""AgentCoreRunner: agentcore-rl-toolkit's ``SlimeRunner`` contract (seed 002) on rayrl.

    AgentCoreRunner(
        exp_id="gsm8k-3b-smoke",
        agent_runtime_arn="arn:aws:bedrock-agentcore:us-west-2:123456789012:runtime/math_agent-AbCdEf1234",
        s3_bucket="my-bucket",
        model_dir="/path/to/Qwen2.5-3B-Instruct",
        data_path="/path/to/gsm8k_tiny.jsonl",
        model_type="qwen2.5-3B",
    ).train(num_rollout=10)

The six required fields name the experiment; the optional ones cover the cluster, AgentCore and the
toolkit's settings, the hyperparameters and wandb; ``extra_flags`` go to driver.py verbatim (dotted
config overrides such as ``algorithm.kl_loss_coef=0.01``, or driver flags such as ``--resume``). Every field
maps onto the run config (:meth:`AgentCoreRunner.overrides`, on top of ``config``, the AgentCore example's
YAML by default), so :meth:`run_config` shows, and checks before anything is submitted, exactly the
``RunConfig`` the job will train with. docs/agentcore.md maps each toolkit field to its config key.

``train(num_rollout)`` submits through Ray's Job Submission SDK (jobs/runner.py ``Runner``): no shell
script, no ``pkill``, no ``ray stop``; a rollout is a training step. ``model_type`` (``qwen2.5-3B``,
``qwen3-8B``, ``deepseek-r1``) picks the model family's tool-call and reasoning parsers
(rayrl/gateway/families.py); engines and trainer read everything else from ``model_dir``'s HF config,
so there is no per-model argument script. The job's environment carries ``PYTHONPATH`` (``pythonpath``,
relative to the uploaded working directory, which is every process's working directory), on GPU
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron's communication overlap needs it), and the wandb variables
only when a wandb key is set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from jobs.runner import Runner, YamlDataclass
from rayrl.config import RunConfig
from rayrl.gateway.families import DEFAULT_FAMILY, family_of
from rayrl.resolve import load_checked
from rayrl.trainers.backend import trainer_backend

_REQUIRED = ("exp_id", "agent_runtime_arn", "s3_bucket", "model_dir", "data_path", "model_type")


@dataclass
class AgentCoreRunner(YamlDataclass):
    """One AgentCore experiment as a Ray job (module docstring)."""

    # -- per experiment (required) ------------------------------------------------------------------
    exp_id: str  # run name -> exp_id; also the job's submission id prefix
    agent_runtime_arn: str  # -> agentcore.runtime_arn (its region -> agentcore.region)
    s3_bucket: str  # -> agentcore.s3_bucket
    model_dir: str  # -> model.path (an HF directory on the cluster)
    data_path: str  # -> data.train_path (JSONL rows {"prompt", "metadata"}: metadata is the agent payload)
    model_type: str  # e.g. qwen2.5-3B: the model family (gateway parsers); architecture comes from model_dir
    # -- cluster --------------------------------------------------------------------------------------
    address: str = "http://127.0.0.1:8265"  # the cluster's dashboard / job API
    working_dir: str = "."  # uploaded to the cluster; must contain driver.py
    config: str = "examples/agentcore/config.yaml"  # base run config, relative to working_dir
    num_gpus: int = 0  # 0: the CPU path; N: N colocated trainer ranks and N / tensor_parallel_size engines
    tensor_parallel_size: int = 1  # -> engine.tp_size (and trainer.tp_size with the megatron backend)
    trainer_backend: str = "torch"  # -> trainer.backend: torch | megatron
    schedule: str = "sync"  # -> pipeline.schedule: sync | async | colocated_async
    pythonpath: list[str] = field(default_factory=lambda: ["."])  # the job's PYTHONPATH, relative to working_dir
    env_vars: dict[str, str] = field(default_factory=dict)  # more job environment (win over the defaults)
    pip: list[str] = field(default_factory=list)  # extra pip packages for the job's runtime_env
    excludes: list[str] = field(default_factory=lambda: [".venv", "runs", ".cache", ".git"])  # not uploaded
    entrypoint_num_cpus: float = 0.0  # CPUs reserved for the driver process
    auth_token: str | None = None  # Ray token auth (default: $RAY_AUTH_TOKEN, ~/.ray/auth_token)
    # -- AgentCore and the toolkit's settings -------------------------------------------------------
    region: str | None = None  # -> agentcore.region (None: the ARN's region)
    s3_prefix: str = "rollouts"  # -> agentcore.s3_prefix
    max_concurrent: int = 100  # -> agentcore.max_concurrent (sessions in flight, whole run)
    acr_tps_limit: float = 25.0  # -> agentcore.acr_tps_limit (invoke requests per second, whole run)
    max_pool_connections: int = 256  # -> agentcore.max_pool_connections (botocore pool; >= max_concurrent)
    session_timeout_s: float = 900.0  # -> agentcore.session_timeout_s
    gateway_public_host: str | None = None  # -> agentcore.gateway_public_host (+ gateway.host 0.0.0.0)
    cumulative_token_mode: bool = True  # -> gateway.cumulative_token_mode
    tool_call_parser: str = "auto"  # -> gateway.tool_parser (auto: model_type's family)
    reasoning_parser: str = "auto"  # -> gateway.reasoning_parser (auto: model_type's family)
    context_length: int = 4096  # -> engine.context_length (the toolkit's sglang_context_length)
    reward: str = "agent_reported"  # -> rollout.reward (a registered name or package.module:function)
    val_data_path: str | None = None  # -> data.val_path
    eval_interval: int = 0  # -> pipeline.eval_interval (0: no validation)
    eval_max_concurrent: int = 16  # -> pipeline.eval_max_concurrent
    # -- hyperparameters ----------------------------------------------------------------------------
    lr: float = 1e-6  # -> trainer.lr
    rollout_batch_size: int = 32  # -> rollout.prompts_per_step (tasks per rollout)
    n_samples_per_prompt: int = 8  # -> rollout.group_size (episodes per task, the GRPO group)
    max_response_len: int = 1024  # -> rollout.max_tokens (per LLM call)
    temperature: float = 1.0  # -> rollout.temperature
    max_turns: int = 8  # -> rollout.max_turns (handed to the agent in rollout_config)
    # -- wandb ----------------------------------------------------------------------------------------
    wandb_project: str | None = None  # -> logging.wandb_project
    wandb_key: str | None = None  # WANDB_API_KEY for the job (default: the submitting shell's); wandb is on only
    # with a key
    wandb_entity: str | None = None  # WANDB_ENTITY for the job (with a key only)
    # -- escape hatch -------------------------------------------------------------------------------
    extra_flags: list[str] = field(default_factory=list)  # passed verbatim to driver.py, after everything above

    def __post_init__(self) -> None:
        for name in _REQUIRED:
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"AgentCoreRunner.{name} is required")
        parts = self.agent_runtime_arn.split(":")
        if len(parts) < 6 or parts[0] != "arn" or not parts[3]:
            raise ValueError(f"AgentCoreRunner.agent_runtime_arn: not an ARN with a region: {self.agent_runtime_arn!r}")

    # -- the mapping onto the run config ------------------------------------------------------------

    @property
    def arn_region(self) -> str:
        return self.agent_runtime_arn.split(":")[3]

    def wandb_api_key(self) -> str | None:
        return self.wandb_key or os.environ.get("WANDB_API_KEY") or None

    def overrides(self) -> list[str]:
        """Dotted config overrides for every field that is not a driver argument of its own."""
        out = [
            "rollout.agent=agentcore",
            f"rollout.reward={self.reward}",
            f"agentcore.runtime_arn={self.agent_runtime_arn}",
            f"agentcore.s3_bucket={self.s3_bucket}",
            f"agentcore.region={self.region or self.arn_region}",
            "agentcore.local_agent_command=[]",  # the real service: no local emulator
            f"agentcore.s3_prefix={self.s3_prefix}",
            f"agentcore.max_concurrent={self.max_concurrent}",
            f"agentcore.acr_tps_limit={self.acr_tps_limit}",
            f"agentcore.max_pool_connections={self.max_pool_connections}",
            f"agentcore.session_timeout_s={self.session_timeout_s}",
            f"gateway.cumulative_token_mode={str(self.cumulative_token_mode).lower()}",
            f"engine.context_length={self.context_length}",
            f"trainer.lr={self.lr}",
            f"trainer.backend={self.trainer_backend}",
            f"pipeline.schedule={self.schedule}",
            f"rollout.prompts_per_step={self.rollout_batch_size}",
            f"rollout.group_size={self.n_samples_per_prompt}",
            f"rollout.max_tokens={self.max_response_len}",
            f"rollout.temperature={self.temperature}",
            f"rollout.max_turns={self.max_turns}",
        ]
        out += self._parser_overrides()
        if self.gateway_public_host:
            out += ["gateway.host=0.0.0.0", f"agentcore.gateway_public_host={self.gateway_public_host}"]
        if self.val_data_path:
            out += [f"data.val_path={self.val_data_path}", f"pipeline.eval_interval={self.eval_interval}",
                    f"pipeline.eval_max_concurrent={self.eval_max_concurrent}"]
        out += self._gpu_overrides()
        if self.wandb_api_key():
            out.append("logging.wandb=true")
            if self.wandb_project:
                out.append(f"logging.wandb_project={self.wandb_project}")
        return out

    def _parser_overrides(self) -> list[str]:
        family = family_of("", self.model_type)
        tool = self.tool_call_parser
        reasoning = self.reasoning_parser
        if family is not DEFAULT_FAMILY:  # a known family: its parsers, unless named outright
            tool = family.tool_parser if tool == "auto" else tool
            reasoning = family.reasoning_parser if reasoning == "auto" else reasoning
        return [f"gateway.tool_parser={tool}", f"gateway.reasoning_parser={reasoning}"]

    def _gpu_overrides(self) -> list[str]:
        if self.num_gpus <= 0:
            return []
        tp = self.tensor_parallel_size
        out = ["placement.mode=colocated", f"placement.num_gpus={self.num_gpus}", f"trainer.num_ranks={self.num_gpus}",
               f"engine.num_engines={max(1, self.num_gpus // tp)}", f"engine.tp_size={tp}", "engine.backend=sglang"]
        if trainer_backend(self.trainer_backend).model_parallel:  # its ranks split the model as the engines do
            out.append(f"trainer.tp_size={tp}")
        return out

    def job_env(self) -> dict[str, str]:
        """The job's environment: PYTHONPATH; CUDA_DEVICE_MAX_CONNECTIONS=1 on GPU; wandb's only with a key."""
        env = {"PYTHONPATH": os.pathsep.join(self.pythonpath)}
        if self.num_gpus > 0:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        key = self.wandb_api_key()
        if key:
            env["WANDB_API_KEY"] = key
            if self.wandb_entity:
                env["WANDB_ENTITY"] = self.wandb_entity
        env.update(self.env_vars)
        return env

    def to_runner(self, num_rollout: int = 1) -> Runner:
        """The generic job (jobs/runner.py) this experiment submits: ``num_rollout`` training steps."""
        return Runner(
            exp_id=self.exp_id, config=self.config, address=self.address, working_dir=self.working_dir,
            model_path=self.model_dir, data_path=self.data_path, steps=num_rollout,
            overrides=self.overrides(), extra_args=list(self.extra_flags), env_vars=self.job_env(),
            pip=list(self.pip), excludes=list(self.excludes), entrypoint_num_cpus=self.entrypoint_num_cpus,
            auth_token=self.auth_token,
        )

    def run_config(self, num_rollout: int = 1) -> RunConfig:
        """The RunConfig the job will load (driver flags in ``extra_flags`` aside); raises ConfigError
        naming the field for anything invalid, here, before a job is submitted."""
        args = self.to_runner(num_rollout).driver_args()
        dotted = [a for a in args[2:] if not a.startswith("--")]
        return load_checked(Path(self.working_dir) / self.config, dotted)

    # -- submission ---------------------------------------------------------------------------------

    def train(self, num_rollout: int = 1, agent_wait_s: float = 120.0) -> str:
        """Check the run config, then submit the job; returns its submission id (``to_runner()`` has
        ``wait``, ``logs`` and ``stop`` for it). ``agent_wait_s``: how long a cluster that just started
        may take to accept jobs (``Runner.submit``)."""
        self.run_config(num_rollout)
        return self.to_runner(num_rollout).submit(agent_wait_s)
