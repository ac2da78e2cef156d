"""The driver process imports no torch (nor openai, transformers, safetensors): issue 46's start.

Why: ``python driver.py`` spends its first seconds before Ray starts, and every second there is a second
of every start and resume (torch alone took 1.5-2.5 s of it on the 2-core machine). The driver never runs
a model, a loss or a weight sender: those run in the trainer ranks, the engines and the rollout workers,
which import what they need in their own processes. So the modules driver.py imports (read from its own
import statements, the ones inside ``main`` included, so a new one is covered), the checks it runs before
Ray (load, preflight, resolve) and the pipeline's modules it imports once Ray is up must leave these out.

A fresh interpreter runs it (this test process has torch loaded by others).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "openai", "transformers", "safetensors")  # what the driver's own work never needs

PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
from rayrl.config import load_config
from rayrl.config.paths import absolute_outputs
from rayrl.preflight import preflight
from rayrl.resolve import resolve
from rayrl.metrics import MetricsLogger
cfg = absolute_outputs(load_config({config!r}, []))
preflight(cfg)  # what driver.main checks before Ray starts
cfg = resolve(cfg)  # what the Pipeline makes concrete once it starts
MetricsLogger(cfg.logging, cfg.run_dir)  # made before the first rollout
print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r}))))
"""


def driver_modules() -> list[str]:
    """Every module driver.py imports, at its top and inside its functions (ray's own left to Ray)."""
    names = []
    for node in ast.walk(ast.parse((ROOT / "driver.py").read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return sorted({n for n in names if n.split(".")[0] in ("rayrl", "actors")} | {"driver"})


def python(code: str, cache: Path) -> str:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(Path.home()), "RAYRL_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return (out.stdout.strip().splitlines() or [""])[-1]


def heavy_in_driver(config: str, tmp_path: Path) -> list[str]:
    """The heavy packages in the driver's process, on a start after the first (the machine's facts cached)."""
    python("from rayrl.machine import Machine; Machine.detect()", tmp_path / "cache")  # what a first start leaves
    code = PROBE.format(modules=driver_modules(), config=config, heavy=HEAVY)
    return json.loads(python(code, tmp_path / "cache"))


def test_the_driver_modules_are_read_from_driver_py():
    modules = driver_modules()
    assert {"actors.pipeline", "actors.runtime", "rayrl.preflight", "rayrl.config"} <= set(modules), modules


def test_the_driver_process_imports_no_torch(tmp_path):
    config = tmp_path / "config.yaml"  # the default run, its outputs under tmp_path
    config.write_text((ROOT / "examples" / "calculator" / "config.yaml").read_text().replace(
        "output_dir: runs", f"output_dir: {tmp_path / 'runs'}").replace(
        "examples/calculator/data", str(ROOT / "examples" / "calculator" / "data")))
    assert heavy_in_driver(str(config), tmp_path) == []


def test_the_machine_facts_are_asked_of_torch_once_per_key(tmp_path):
    """The first start asks torch (and keeps the answer); the next reads it without importing torch; a
    change that can change torch's answer (a device hidden) asks torch again; so does a damaged file."""
    probe = ("import json, os, sys; os.environ.update({env!r}); from rayrl.machine import Machine; "
             "m = Machine.detect(); print(json.dumps([m.cuda, m.native_bf16, 'torch' in sys.modules]))")
    truth = ("import json, torch; from rayrl.machine import cpu_has_native_bf16; "
             "print(json.dumps([torch.cuda.is_available(), cpu_has_native_bf16()]))")
    first = json.loads(python(probe.format(env={}), tmp_path))
    assert first == [*json.loads(python(truth, tmp_path)), True]  # torch's own answers, asked of it
    assert json.loads(python(probe.format(env={}), tmp_path)) == [*first[:2], False]  # read: torch not imported
    assert len(list((tmp_path / "machine").iterdir())) == 1
    assert json.loads(python(probe.format(env={"CUDA_VISIBLE_DEVICES": ""}), tmp_path))[2] is True
    assert len(list((tmp_path / "machine").iterdir())) == 2
    for path in (tmp_path / "machine").iterdir():
        path.write_text("{")
    assert json.loads(python(probe.format(env={}), tmp_path)) == first
    assert sum(p.read_text() != "{" for p in (tmp_path / "machine").iterdir()) == 1  # mended
