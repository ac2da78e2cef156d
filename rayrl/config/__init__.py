"""One typed run configuration: YAML -> ``RunConfig`` (dataclasses), validated at load, resolved once.

- schema.py: ``RunConfig`` and the run-level sections; the other sections by area in serving.py,
  rollout.py, training.py, algorithm.py and guards.py. Every field's type, default and documentation (the comment
  beside it; docs/config.md is generated from them); ``Literal`` types for fixed choices; each section
  checks its own ranges, ``RunConfig`` the rules that span sections.
- load.py: ``load_config`` (YAML + dotted overrides through OmegaConf) and ``to_yaml``.
- resolve.py: ``resolve(cfg, machine)`` turns every "auto" value into a concrete one, in one place.
- checks.py, host_rules.py: ``ConfigError`` with the range checks, and the ``sandbox.allowed_hosts`` parser.

Every error is a :class:`ConfigError` whose message starts with the dotted field name. This package
imports nothing else from rayrl at import time, so any module can import it without an import cycle (the
algorithm checks look the estimator and loss registries up when a config is built).
"""

from rayrl.config.algorithm import AlgorithmConfig
from rayrl.config.checks import ConfigError
from rayrl.config.data_sources import ReasoningGymSource
from rayrl.config.guards import GuardsConfig
from rayrl.config.load import load_config, to_yaml
from rayrl.config.resolve import Machine, capacity_warnings, resolve
from rayrl.config.rollout import AgentCoreConfig, JudgeConfig, RolloutConfig, SandboxConfig, SandboxPoolConfig
from rayrl.config.schema import DataConfig, DataFields, LoggingConfig, PipelineConfig, RayConfig, RunConfig
from rayrl.config.serving import (
    EngineConfig,
    GatewayConfig,
    ModelConfig,
    SGLangConfig,
    TrajectoryConfig,
    VLLMConfig,
)
from rayrl.config.training import LoraConfig, PlacementConfig, TrainerConfig

__all__ = [
    "AlgorithmConfig",
    "AgentCoreConfig",
    "ConfigError",
    "DataConfig",
    "DataFields",
    "EngineConfig",
    "GatewayConfig",
    "GuardsConfig",
    "JudgeConfig",
    "LoggingConfig",
    "LoraConfig",
    "Machine",
    "ModelConfig",
    "PipelineConfig",
    "PlacementConfig",
    "RayConfig",
    "ReasoningGymSource",
    "RolloutConfig",
    "RunConfig",
    "SandboxConfig",
    "SGLangConfig",
    "VLLMConfig",
    "SandboxPoolConfig",
    "TrainerConfig",
    "TrajectoryConfig",
    "capacity_warnings",
    "load_config",
    "resolve",
    "to_yaml",
]
