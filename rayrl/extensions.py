"""The config's ``package.module:name`` references (your agent, reward, tree callback): import, check, name the field.

One home for turning ``rollout.agent: my_pkg.agent:solve`` into the object it names. Every failure is a
:class:`~rayrl.config.ConfigError` whose message starts with the config field and fits on one line:
the module cannot be found, importing it raised (with the file and line where), the name is missing, or
the object cannot be called the way rayrl will call it. driver.py runs these checks before Ray starts
(rayrl/preflight.py), so a typo costs a second, not an engine start-up and a traceback from a worker.

Modules are imported the way Python finds them in the driver: from the directory you run
``python driver.py`` in (it is put first on ``sys.path``, as ``python -m`` would) and from
``PYTHONPATH``. Under ``ray job submit --working-dir DIR`` that directory is the job's working
directory on every node (docs/agents.md).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
import traceback
from typing import Any, Callable, Mapping

from rayrl.config import ConfigError


def split_reference(ref: str, field: str) -> tuple[str, str]:
    """``("package.module", "name")`` from ``"package.module:name"``; a ConfigError naming ``field`` otherwise."""
    module, sep, name = str(ref).partition(":")
    if not sep or not module or not name or ":" in name:
        raise ConfigError(f"{field}: {ref!r} is not 'package.module:name'")
    return module, name


def cwd_on_path() -> None:
    """Put the current directory first on ``sys.path`` (once): user modules resolve from where the run
    was started, as ``python -m`` resolves them, even though driver.py lives elsewhere."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def _where(err: BaseException, module: str) -> str:
    """`` (file:line)`` of the innermost frame of ``err`` inside the user's module tree, if any."""
    frames = traceback.extract_tb(err.__traceback__)
    if isinstance(err, SyntaxError) and err.filename:
        return f" ({err.filename}:{err.lineno})"
    top = module.split(".")[0]
    inside = [f for f in frames if f"/{top}/" in f.filename or f.filename.endswith(f"/{top}.py")]
    frame = (inside or frames or [None])[-1]
    return f" ({frame.filename}:{frame.lineno})" if frame is not None else ""


def load_reference(ref: str, field: str) -> Any:
    """The object ``ref`` (``package.module:name``) names; ConfigError naming ``field`` when it cannot be had."""
    module_name, name = split_reference(ref, field)
    cwd_on_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ConfigError(f"{field}: no module named {err.name!r} (from {ref!r}; searched the current "
                              f"directory {os.getcwd()} and PYTHONPATH)") from None
        raise ConfigError(f"{field}: importing {module_name!r} failed: {type(err).__name__}: {err}"
                          f"{_where(err, module_name)}") from None
    except Exception as err:
        text = err.msg if isinstance(err, SyntaxError) else (str(err).splitlines() or [""])[0]
        raise ConfigError(f"{field}: importing {module_name!r} failed: {type(err).__name__}: {text}"
                          f"{_where(err, module_name)}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        hint = did_you_mean(name, public) or f" (it has: {', '.join(public[:12])})"
        raise ConfigError(f"{field}: module {module_name!r} has no {name!r}{hint}") from None


def signature_of(obj: Callable[..., Any]) -> inspect.Signature | None:
    """``inspect.signature(obj)``, or None for callables Python cannot describe (some builtins)."""
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def check_call(obj: Any, field: str, ref: str, args: tuple[str, ...], how: str) -> None:
    """``obj`` must accept ``len(args)`` positional arguments (named ``args`` in the message); ``how`` is the
    call as the docs write it, e.g. ``reward(task, result) -> float``."""
    if not callable(obj):
        raise ConfigError(f"{field}: {ref!r} is a {type(obj).__name__}, not a function; rayrl calls {how}")
    sig = signature_of(obj)
    if sig is None:
        return
    try:
        sig.bind(*args)
    except TypeError as err:
        raise ConfigError(f"{field}: {ref}{parameters(sig)} cannot be called as {how} ({err})") from None


def parameters(sig: inspect.Signature) -> str:
    """``(a, b=..., *args)``: a signature's parameter names without annotations, for messages."""
    names = []
    for p in sig.parameters.values():
        prefix = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
        names.append(prefix + p.name + ("=..." if p.default is not p.empty else ""))
    return "(" + ", ".join(names) + ")"


def did_you_mean(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for a close match among ``choices``, else ""."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def named_callable(field_name: str, value: str, names: Mapping[str, Any]) -> Any:
    """``names[value]``, or the callable a ``package.module:function`` names; else a ConfigError naming
    ``field_name``. The algorithm's tables (rayrl/rl/advantages.py, rayrl/rl/policy_losses.py) look
    their names up with it; the resolve step (rayrl/resolve.py) checks the config's names through them."""
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
