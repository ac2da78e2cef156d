"""YAML + dotted overrides -> a validated ``RunConfig`` (OmegaConf structured config), and back to YAML.

OmegaConf does the typing: an unknown key, a value of the wrong type or a value outside a ``Literal``
fails with the dotted name of the field. The dataclasses check their own ranges as OmegaConf builds them
(rayrl/config/schema.py). Every failure comes out as :class:`ConfigError` whose message starts with the
field's dotted name, never as an OmegaConf exception.

``load_config`` returns the config as written: "auto" values stay 0 / None / ``auto`` until
:func:`rayrl.resolve` makes them concrete for a machine. A run records ``to_yaml(resolve(cfg))``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rayrl.config.checks import ConfigError
from rayrl.config.schema import RunConfig

# keys a config may still carry from an older rayrl, and what to write instead (checked before OmegaConf,
# whose own message would only say the key is unknown)
_ALGORITHMS = " (docs/algorithms.md)"
REMOVED_KEYS = {
    "trainer.loss": "removed; it selected nothing; write algorithm.advantage_estimator (grpo, dr_grpo, rloo, "
                    "reinforce_pp, reinforce_pp_baseline) and algorithm.policy_loss (ppo_clip, gspo, cispo, sft)"
                    + _ALGORITHMS,
    "trainer.clip_eps": "removed; write algorithm.clip_eps" + _ALGORITHMS,
    "trainer.clip_eps_high": "removed; write algorithm.clip_eps_high" + _ALGORITHMS,
    "trainer.tis_cap": "removed; write algorithm.tis_cap" + _ALGORITHMS,
    "trainer.normalize_advantage_std": "removed; write algorithm.advantage_estimator: grpo (true: divide by the "
                                       "group's reward std) or dr_grpo (false)" + _ALGORITHMS,
    "trainer.kl_coef": "removed; it penalised the distance to the rollout log-probs; for a KL to a frozen reference "
                       "model write algorithm.kl_loss_coef (with algorithm.kl_loss_type: k3, the same estimator)"
                       + _ALGORITHMS,
    "engine.mem_fraction_static": "moved; write engine.sglang.mem_fraction_static (SGLang's own options are the "
                                  "engine.sglang section, docs/config.md)",
    "engine.enable_memory_saver": "moved; write engine.sglang.enable_memory_saver (SGLang's own options are the "
                                  "engine.sglang section, docs/config.md)",
}


def _check_removed(loaded: object, overrides: Sequence[str]) -> None:
    """A ConfigError naming the first removed or moved key in the YAML mapping or the overrides, with what
    to write instead."""
    keys = [item.split("=", 1)[0].strip() for item in overrides]
    if isinstance(loaded, DictConfig):
        for section, body in loaded.items():
            if isinstance(body, DictConfig):
                keys += [f"{section}.{key}" for key in body.keys()]
    for key in keys:
        if key in REMOVED_KEYS:
            raise ConfigError(f"{key}: {REMOVED_KEYS[key]}")


def _describe(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    msg = str(err).split("\n")[0]
    return f"{key}: {msg}" if key else msg


def _merge(base: Any, other: Any, where: str) -> Any:
    """``OmegaConf.merge`` whose errors name a field: the node's own key, else ``where`` (the override's key or
    the file); a list given where a mapping belongs (or the reverse) is a TypeError in OmegaConf."""
    try:
        return OmegaConf.merge(base, other)
    except TypeError as err:
        raise ConfigError(f"{where}: {err} (a list where a mapping belongs, or the reverse)") from None
    except OmegaConfBaseException as err:
        raise ConfigError(_describe(err) if getattr(err, "full_key", None) else f"{where}: {_describe(err)}") from None


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load ``path`` (YAML), apply dotted ``overrides`` (``trainer.steps=3``), validate, return dataclasses.

    Raises ConfigError naming the field for unknown keys, wrong types and invalid values. The result is
    not resolved (see :func:`rayrl.resolve`).
    """
    schema = OmegaConf.structured(RunConfig)
    try:
        merged = schema
        loaded = None
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file not found: {p}")
            loaded = OmegaConf.load(p)
            if not isinstance(loaded, DictConfig) and loaded is not None:
                raise ConfigError(f"{p}: the top level must be a mapping")
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected dotted.key=value")
        _check_removed(loaded, overrides)
        if loaded is not None:
            merged = _merge(merged, loaded, str(path))
        for item in overrides:  # one at a time, so an error without a key of its own names the override's
            if "[" not in item.split("=", 1)[0]:
                merged = _merge(merged, OmegaConf.from_dotlist([item]), item.split("=", 1)[0])
        for item in overrides:  # a list entry's field (data.reasoning_gym[0].size=50): set in place, typed
            key, value = item.split("=", 1)
            if "[" in key:
                OmegaConf.update(merged, key, OmegaConf.from_dotlist([f"v={value}"]).v, merge=True)
        cfg = OmegaConf.to_object(merged)  # the dataclasses' __post_init__ checks raise ConfigError here
    except OmegaConfBaseException as err:
        raise ConfigError(_describe(err)) from None
    assert isinstance(cfg, RunConfig)
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    """``cfg`` as YAML that :func:`load_config` reads back (a run saves its resolved config this way)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
