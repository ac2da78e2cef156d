"""The SGLang launch path: the exact command line, and launch / health wait / log capture / teardown of a
real process speaking SGLang's HTTP API (``tests/engines/fake_sglang``: a ``sglang.launch_server``
stand-in that serves the CPU engine, since SGLang itself needs a GPU)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from rayrl.config import EngineConfig, SGLangConfig
from rayrl.engines.backends.sglang import sglang_command
from rayrl.engines.client import EngineClient
from rayrl.engines.launcher import EngineLaunchError, EngineProcess

STAND_IN = Path(__file__).parent / "fake_sglang"
ROOT = Path(__file__).resolve().parents[2]


def _cfg(**kw) -> EngineConfig:
    base = dict(tp_size=2, sglang=SGLangConfig(mem_fraction_static=0.6), dtype="float32", context_length=512,
                max_batch_size=4, startup_timeout_s=180)  # fmt: skip
    return EngineConfig(**{**base, **kw})


def test_sglang_command_line():
    cmd = sglang_command(_cfg(), "/models/qwen", 30011, python="/py", weight_version="7")
    assert cmd[:3] == ["/py", "-m", "sglang.launch_server"]
    args = cmd[3:]
    assert "--enable-memory-saver" in args
    args.remove("--enable-memory-saver")
    flags = dict(zip(args[::2], args[1::2]))
    assert flags == {
        "--model-path": "/models/qwen", "--tp-size": "2", "--mem-fraction-static": "0.6", "--dtype": "float32",
        "--context-length": "512", "--max-running-requests": "4", "--weight-version": "7",
        "--host": "127.0.0.1", "--port": "30011",
    }  # fmt: skip
    off = sglang_command(_cfg(sglang=SGLangConfig(enable_memory_saver=False), extra_args=["--log-level", "debug"]),
                         "/m", 1)
    assert "--enable-memory-saver" not in off and off[-2:] == ["--log-level", "debug"]


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(STAND_IN), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


def test_launch_health_and_teardown(tiny_model, tmp_path):
    """Launch, health wait, a generation, teardown and the log; and the process's environment: CUDA-graph
    memory is released only with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 in it, and NCCL_CUMEM_ENABLE must be what
    the trainer ranks use (rayrl.engines.backends.sglang.NCCL_ENV). One process for both: each start costs seconds."""
    from rayrl.engines.backends.sglang import NCCL_ENV

    log = tmp_path / "sglang-0.log"
    proc = EngineProcess(_cfg(), str(tiny_model), log, backend="sglang", env=_env(), weight_version="3")
    with proc:
        assert proc.healthy() and proc.url.startswith("http://127.0.0.1:")
        raw = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
        assert env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1"
        assert env["NCCL_CUMEM_ENABLE"] == NCCL_ENV["NCCL_CUMEM_ENABLE"] == "0"

        async def talk() -> tuple[dict, int]:
            client = EngineClient(proc.url)
            info = await client.get_server_info()
            out = await client.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
            await client.close()
            return info, out.completion_tokens

        info, n = asyncio.run(talk())
        assert n == 4
        assert info["tp_size"] == 2 and info["enable_memory_saver"] is True
        assert info["mem_fraction_static"] == 0.6 and info["weight_version"] == "3"
        pid, port = proc.pid, proc.port
    assert not proc.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with socket.socket() as s:  # the port is closed again
        assert s.connect_ex(("127.0.0.1", port)) != 0
    text = log.read_text()
    assert "starting:" in text and "-m sglang.launch_server" in text and "ready at" in text


def test_bad_flag_fails_with_the_servers_reason(tiny_model, tmp_path):
    proc = EngineProcess(_cfg(extra_args=["--no-such-flag"]), str(tiny_model), tmp_path / "bad.log",
                         backend="sglang", env=_env())  # fmt: skip
    with pytest.raises(EngineLaunchError, match="exited with code") as err:
        proc.start()
    assert "unrecognized arguments: --no-such-flag" in str(err.value)

