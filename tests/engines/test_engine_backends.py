"""Engine backends are one table (rayrl/engines/backends/): each row owns what differs between servers,
and the config, its resolution and the launcher ask the row rather than compare names."""

from __future__ import annotations

import pytest

from rayrl.config import ConfigError, EngineConfig, RunConfig
from rayrl.engines.backends import BACKENDS, auto_backend, engine_backend
from rayrl.engines.backends.base import EngineBackend
from rayrl.engines.launcher import EngineProcess
from rayrl.machine import Machine
from rayrl.resolve import check, load_checked, resolve


def test_the_table_is_what_engine_backend_takes(monkeypatch):
    """engine.backend is checked against the table at load (its one source of names)."""
    import sys

    monkeypatch.setattr("rayrl.engines.backends.vllm._has_vllm", lambda python: "")  # the vllm rows' own check
    for name in ("auto", *BACKENDS):
        cfg = load_checked(None, [f"engine.backend={name}", f"engine.vllm.python={sys.executable}"])
        assert cfg.engine.backend == name
    with pytest.raises(ConfigError, match=r"^engine.backend: 'tgi' is not one of auto, cpu, sglang, vllm, vllm-cpu$"):
        load_checked(None, ["engine.backend=tgi"])
    assert all(isinstance(b, EngineBackend) and b.name == name for name, b in BACKENDS.items())
    with pytest.raises(ValueError, match=r"^engine.backend: 'tgi' is not one of cpu, sglang, vllm, vllm-cpu"):
        engine_backend("tgi")


def test_auto_and_the_auto_dtype_follow_the_row():
    for cuda in (False, True):
        machine = Machine(cores=4, cuda=cuda, native_bf16=False)
        engine = resolve(RunConfig(), machine).engine
        assert engine.backend == auto_backend(cuda)
        assert engine_backend(engine.backend).on_gpu is cuda
        assert engine.dtype == ("bfloat16" if cuda else "float32")


def test_the_launcher_runs_the_rows_command_with_its_environment(tmp_path):
    cfg = EngineConfig(backend="sglang")
    for name, backend in BACKENDS.items():
        proc = EngineProcess(cfg, "/m", tmp_path / "x.log", backend=name, port=30001, weight_version="4")
        assert proc.command() == backend.command(cfg, "/m", 30001, weight_version="4")
        assert proc.spec is backend
    assert "SGLANG_MEMORY_SAVER_CUDA_GRAPH" in BACKENDS["sglang"].env(cfg)
    assert BACKENDS["cpu"].env(cfg) == {}


def test_weight_formats_are_the_rows():
    EngineConfig(backend="cpu", weight_format="fp16-packed")
    with pytest.raises(ConfigError, match="^engine.weight_format: fp16-packed is the CPU engine's; sglang takes"):
        check(RunConfig(engine=EngineConfig(backend="sglang", weight_format="fp16-packed")))
    assert [n for n, b in BACKENDS.items() if "fp16-packed" in b.weight_formats] == ["cpu"]
