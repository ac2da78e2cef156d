"""The algorithm's registries by name: a registered name, or ``package.module:function`` for your own.

Its own module so that the registries (rayrl/rl/advantages.py, rayrl/trainers/policy_losses.py) and the
config that checks their names at load (rayrl/config/algorithm.py) share one resolver without importing
each other.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

from rayrl.config.checks import ConfigError


def named_callable(field_name: str, value: str, names: Mapping[str, Callable[..., Any]]) -> Callable[..., Any]:
    """``names[value]``, or the callable a ``package.module:function`` names; else a ConfigError naming
    ``field_name``. The config checks with it at load; the registries resolve with it when they run."""
    if value in names:
        return names[value]
    module, sep, attr = value.partition(":")
    if not sep:
        raise ConfigError(f"{field_name}: unknown {value!r}; registered: {', '.join(sorted(names))}, "
                          "or package.module:function")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{field_name}: cannot load {value!r}: {type(err).__name__}: {err}") from None
    if not callable(fn):
        raise ConfigError(f"{field_name}: {value!r} is not callable")
    return fn
