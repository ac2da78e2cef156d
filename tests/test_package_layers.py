"""Which package may import which (docs/architecture.md), read from the source's own import statements, the
ones inside functions included, so a lazy import cannot hide a dependency.

- rayrl/ never imports Ray (actors/ are the Ray shells).
- rayrl/config is the schema as pure data: it imports nothing of rayrl but itself and rayrl.types.
- What is optimised lives with the RL logic: rayrl/rl imports nothing from rayrl/trainers.
- The engines: rayrl/engines keeps the engine-agnostic client side and imports neither engine package
  (its package face names them lazily, for ``from rayrl.engines import CPUEngine``); the CPU engine and the
  vLLM adapter import each other not at all; the weight path sends through the client side and imports no
  engine package; the client side imports nothing of rayrl/weights (payloads come to it encoded), so the
  weight code and the client side depend one way only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RAYRL = ROOT / "rayrl"


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; ``from a import b`` gives ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def files(folder: Path, *, skip: tuple[str, ...] = ()) -> list[Path]:
    """The Python files under ``folder``, less those under its subfolders named in ``skip``."""
    return [p for p in sorted(folder.rglob("*.py"))
            if not any(part in skip for part in p.relative_to(folder).parts[:-1])]


def under(name: str, packages: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``packages`` or inside one."""
    return any(name == p or name.startswith(p + ".") for p in packages)


def offenders(paths: list[Path], forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    """``file: module`` for each import of a module under ``forbidden`` and not under ``allowed``."""
    return [f"{path.relative_to(ROOT)}: {name}" for path in paths for name in sorted(imported(path))
            if under(name, forbidden) and not under(name, allowed)]


CLIENT_SIDE = files(RAYRL / "engines", skip=("cpu", "vllm"))


@pytest.mark.parametrize("paths, forbidden, allowed", [
    (files(RAYRL), ("ray",), ()),
    (files(RAYRL / "config"), ("rayrl",), ("rayrl.config", "rayrl.types")),
    (files(RAYRL / "rl"), ("rayrl.trainers",), ()),
    (CLIENT_SIDE, ("rayrl.engines.cpu", "rayrl.engines.vllm"), ()),
    (CLIENT_SIDE, ("rayrl.weights",), ()),
    (files(RAYRL / "engines" / "cpu"), ("rayrl.engines.vllm",), ()),
    (files(RAYRL / "engines" / "vllm"), ("rayrl.engines.cpu",), ()),
    (files(RAYRL / "weights"), ("rayrl.engines.cpu", "rayrl.engines.vllm"), ()),
], ids=["rayrl-no-ray", "config-pure-data", "rl-not-trainers", "engine-client-no-engine",
        "engine-client-no-weights", "cpu-not-vllm", "vllm-not-cpu", "weights-no-engine"])
def test_a_package_imports_only_what_its_layer_allows(paths, forbidden, allowed) -> None:
    assert paths, "no files: the layout moved; update this test with docs/architecture.md"
    assert offenders(paths, forbidden, allowed) == []


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from rayrl.trainers.backend import TRAINER_BACKENDS\n    import ray\n")
    assert {"rayrl.trainers.backend", "ray"} <= imported(source)
