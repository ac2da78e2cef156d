"""docs/architecture.md, the map of the code, names only files that exist.

Every path it names (``actors/...``, ``rayrl/...``, ``tests/...``, ``driver.py``, ...) exists; every bare
module it names in backticks (``schedules.py``) is a file somewhere in the code; every dotted
``rayrl.x.y`` reference starts with a module that exists. A move that forgets the map fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("actors", "rayrl", "tests", "jobs", "bench", "scripts", "docs", "examples", "cluster")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/]|driver\.py|Makefile)" % "|".join(TOP))
BARE = re.compile(r"`([\w-]+\.(?:py|cpp|md))`")
DOTTED = re.compile(r"(?<![\w./])(rayrl(?:\.\w+)+)")
CODE = ("actors", "rayrl", "jobs", "bench", "scripts", "tests", "examples")


def _missing_paths(text: str) -> list[str]:
    return sorted({p for p in PATH.findall(text) if not (ROOT / p.rstrip("/.")).exists()})


def _missing_bare(text: str) -> list[str]:
    known = {f.name for top in CODE for f in (ROOT / top).rglob("*") if f.is_file()}
    known |= {f.name for f in ROOT.iterdir()} | {f.name for f in (ROOT / "docs").rglob("*.md")}
    return sorted({name for name in BARE.findall(text) if name not in known})


def _missing_modules(text: str) -> list[str]:
    """A dotted name is a module (file or package) followed by at most two attributes (class, method)."""
    missing = set()
    for dotted in DOTTED.findall(text):
        parts = dotted.split(".")
        found = False
        for cut in range(len(parts), max(len(parts) - 3, 0), -1):
            base = ROOT.joinpath(*parts[:cut])
            if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
                found = True
                break
        if not found:
            missing.add(dotted)
    return sorted(missing)


def check(text: str) -> list[str]:
    return _missing_paths(text) + _missing_bare(text) + _missing_modules(text)


def test_every_path_the_architecture_map_names_exists():
    assert check((ROOT / "docs" / "architecture.md").read_text()) == []


def test_a_wrong_path_a_wrong_module_and_a_wrong_dotted_name_are_each_caught():
    assert check("`actors/pipeline.py`, `schedules.py`, rayrl.gateway.app.Gateway, rayrl/weights/") == []
    assert check("see `rayrl/pipeline/schedules.py`") == ["rayrl/pipeline/schedules.py"]
    assert check("its server (`weight_routes_old.py`)") == ["weight_routes_old.py"]
    assert check("the actor (rayrl.gateway.ap.Gateway.start)") == ["rayrl.gateway.ap.Gateway.start"]
