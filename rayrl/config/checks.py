"""ConfigError and the range checks the config sections run on themselves.

Every section dataclass (rayrl/config/schema.py) checks its own fields in ``__post_init__`` with these
helpers, so a section is valid wherever it is built: by OmegaConf at load, by ``dataclasses.replace`` in
:func:`rayrl.resolve`, or directly in code. The message always starts with the dotted field name
(``trainer.lr: must be > 0, got 0.0``), which is what the command line and the tests show.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem; the message names the offending field."""


def positive(section: object, prefix: str, *names: str) -> None:
    """Each of ``names`` on ``section`` must be > 0; ``prefix`` is the section's dotted name plus a dot."""
    for name in names:
        value = getattr(section, name)
        if not value > 0:
            raise ConfigError(f"{prefix}{name}: must be > 0, got {value!r}")


def non_negative(section: object, prefix: str, *names: str) -> None:
    """Each of ``names`` on ``section`` must be >= 0 (0 usually means off or auto)."""
    for name in names:
        value = getattr(section, name)
        if value < 0:
            raise ConfigError(f"{prefix}{name}: must be >= 0, got {value!r}")


def at_least_one(section: object, prefix: str, *names: str) -> None:
    """Each of ``names`` on ``section`` must be >= 1 (counts and sizes where 0 means nothing)."""
    for name in names:
        value = getattr(section, name)
        if value < 1:
            raise ConfigError(f"{prefix}{name}: must be >= 1, got {value!r}")
