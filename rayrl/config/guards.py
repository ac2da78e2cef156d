"""The ``guards`` section: what each silent-failure guard does when its figure crosses its threshold.

Every guard (rayrl/rl/guards.py: one record each, with its figure and why it matters) has two fields here:
``guards.<name>``, the action (``warn``: one line naming the guard, the figure and an example episode;
``stop``: that line, then a checkpoint and a clean stop with a non-zero exit code and the resume command;
``off``: not checked, the figure is still logged) and ``guards.<name>_max`` or ``_min``, the threshold (a
share, in [0, 1]). The defaults are chosen not to fire on the shipped examples; docs/guards.md has the
table and what to do when one fires.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from rayrl.config.checks import ConfigError

GuardAction = Literal["warn", "stop", "off"]


@dataclass
class GuardsConfig:
    """Silent-failure guards, computed each step from what the gateway recorded (docs/guards.md)."""

    tool_parse_errors: GuardAction = "warn"  # the model wrote tool calls the gateway's parser could not read: warn /
    # stop / off
    tool_parse_errors_max: float = 0.5  # fires above this share of the step's attempted tool calls (parsed or not)
    tool_call_rate: GuardAction = "warn"  # episodes whose task declares tools but that called none: warn / stop / off
    tool_call_rate_min: float = 0.02  # fires below this share of tool-declaring episodes with at least one tool call
    tool_errors: GuardAction = "warn"  # tool results that were errors (as the agent reports them): warn / stop / off
    tool_errors_max: float = 0.75  # fires above this share of the step's tool calls
    unused_tools: GuardAction = "warn"  # rewarded episodes that declared tools and called none (reward hacking, or
    # a task the tools are not needed for): warn / stop / off
    unused_tools_max: float = 0.8  # fires above this share of the rewarded (> 0) tool-declaring episodes
    truncation: GuardAction = "warn"  # episodes cut by rollout.max_tokens (a turn ended at the limit) or max_turns:
    # warn / stop / off
    truncation_max: float = 0.5  # fires above this share of the step's scored episodes
    drift: GuardAction = "warn"  # episodes whose turns do not extend each other token for token (a template that
    # drops earlier reasoning, a client that rewrites history: rayrl/trajectory/drift.py): warn / stop / off
    drift_max: float = 0.25  # fires above this share of the step's episodes with a recorded turn
    infra_failures: GuardAction = "warn"  # episodes failed by infrastructure (engine, sandbox, timeout, ...): warn /
    # stop / off
    infra_failures_max: float = 0.25  # fires above this share of the step's episodes
    reward_failures: GuardAction = "warn"  # episodes whose reward function raised or whose judge gave no verdict: warn
    # / stop / off
    reward_failures_max: float = 0.1  # fires above this share of the step's episodes
    zero_variance_groups: GuardAction = "warn"  # groups whose rewards are all equal, which train nothing: warn / stop
    # / off
    zero_variance_groups_max: float = 0.95  # fires above this share of the step's groups (at least 2 groups)
    one_cause_failures: GuardAction = "stop"  # episodes failed for the same cause (kind and error): a step where every
    # one did trains nothing, so the run stops by default: warn / stop / off
    one_cause_failures_max: float = 0.99  # fires above this share of the step's episodes (at least 4)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith(("_max", "_min")) and not 0.0 <= value <= 1.0:
                raise ConfigError(f"guards.{f.name}: a share, must be in [0, 1], got {value!r}")
