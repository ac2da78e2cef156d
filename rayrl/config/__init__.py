"""One typed run configuration: YAML -> ``RunConfig`` (dataclasses), validated at load, resolved once.

- schema.py: ``RunConfig`` and the run-level sections; the other sections by area in serving.py,
  rollout.py, training.py, algorithm.py and guards.py. Every field's type, default and documentation (the comment
  beside it; docs/config.md is generated from them); ``Literal`` types for fixed choices; each section
  checks its own ranges, ``RunConfig`` the rules that span sections.
- load.py: ``load_config`` (YAML + dotted overrides through OmegaConf) and ``to_yaml``.
- checks.py, host_rules.py: ``ConfigError`` with the range checks, and the ``sandbox.allowed_hosts`` parser.
- paths.py: output paths made absolute on the driver's node.

The config is pure data: this package imports nothing else from rayrl, so any module can import it. The
step above the plug-in tables, rayrl/resolve.py, checks the config's names against them (``check``) and
turns every "auto" value into a concrete one (``resolve``); machine detection is rayrl/machine.py.
Every error is a :class:`ConfigError` whose message starts with the dotted field name.
"""

from rayrl.config.algorithm import AlgorithmConfig
from rayrl.config.checks import ConfigError
from rayrl.config.data_sources import ReasoningGymSource
from rayrl.config.guards import GuardsConfig
from rayrl.config.load import load_config, to_yaml
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
    "load_config",
    "to_yaml",
]
