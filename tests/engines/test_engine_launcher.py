"""EngineProcess: a real CPU engine subprocess (``python -m rayrl.engines.cpu``); launch, health, generate, stop,
failures. (An engine that
dies is replaced by a new actor and process, actors/engine_fleet.py; EngineProcess never restarts a server
that was up: it starts one again only when the port it picked was taken before the server bound it.)"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time

import pytest

from rayrl.config import EngineConfig, SGLangConfig
from rayrl.engines.backends.cpu import cpu_server_command
from rayrl.engines.backends.sglang import sglang_command
from rayrl.engines.client import EngineClient
from rayrl.engines.launcher import EngineLaunchError, EngineProcess


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(
        dtype="float32", max_batch_size=4, context_length=512, num_threads=1, startup_timeout_s=120, **kw
    )


def test_launch_generate_stop(tiny_model, tmp_path):
    proc = EngineProcess(_cfg(), str(tiny_model), tmp_path / "logs" / "engine.log")
    with proc:
        assert proc.alive() and proc.healthy()
        assert proc.url.startswith("http://127.0.0.1:")

        async def generate() -> list[int]:
            client = EngineClient(proc.url)
            info = await client.get_server_info()
            assert info["context_length"] == 512 and info["max_running_requests"] == 4
            out = await client.generate(
                [1, 2, 3], {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
            )
            await client.close()
            return out.output_ids.tolist()

        first = asyncio.run(generate())
        assert len(first) == 3
        assert asyncio.run(generate()) == first  # greedy: the same output again
        pid = proc.pid
    assert not proc.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    log = (tmp_path / "logs" / "engine.log").read_text()
    assert log.count("starting:") == 1 and "ready at" in log


def test_missing_model_path_fails_clearly(tmp_path):
    proc = EngineProcess(_cfg(), str(tmp_path / "no-such-model"), tmp_path / "engine.log")
    start = time.monotonic()
    with pytest.raises(EngineLaunchError) as err:
        proc.start()
    message = str(err.value)
    assert "exited with code" in message and "no-such-model" in message
    assert "not a model directory" in message  # the server's own reason, from the log tail
    assert time.monotonic() - start < 60 and not proc.alive()


def _hold(port: int) -> socket.socket:
    """Something else listening on ``port`` (as a process that took it between pick and bind would)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_server_whose_picked_port_was_taken_starts_again_on_a_fresh_one(tiny_model, tmp_path, caplog):
    proc = EngineProcess(_cfg(), str(tiny_model), tmp_path / "engine.log")
    taken = proc.port
    with _hold(taken), caplog.at_level(logging.WARNING, logger="rayrl.engines.launcher"), proc:
        assert proc.healthy() and proc.port != taken
        log = (tmp_path / "engine.log").read_text()
        assert log.count("starting:") == 2 and "address already in use" in log.lower()
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and f"port {taken} was taken" in warnings[0] and f"port {proc.port}" in warnings[0]


def test_a_port_the_caller_chose_is_not_changed_when_taken(tiny_model, tmp_path):
    with _hold(0) as held:
        port = held.getsockname()[1]
        proc = EngineProcess(_cfg(), str(tiny_model), tmp_path / "engine.log", port=port)
        with pytest.raises(EngineLaunchError, match="exited with code") as err:
            proc.start()
    assert "address already in use" in str(err.value).lower() and proc.port == port
    assert (tmp_path / "engine.log").read_text().count("starting:") == 1


def test_startup_timeout_reports_log_tail(tmp_path):
    """A process that never becomes healthy is stopped, and the error shows its log."""

    class Sleeper(EngineProcess):
        def command(self) -> list[str]:
            return [
                sys.executable,
                "-c",
                "print('warming up forever', flush=True); import time; time.sleep(60)",
            ]

    proc = Sleeper(_cfg(), "unused", tmp_path / "sleeper.log")
    with pytest.raises(EngineLaunchError, match="not healthy after") as err:
        proc.start(timeout_s=1.5)
    assert "warming up forever" in str(err.value) and not proc.alive()


def test_command_builders():
    cfg = EngineConfig(tp_size=2, sglang=SGLangConfig(mem_fraction_static=0.6), dtype="bfloat16",
                       extra_args=["--foo", "1"])
    sg = sglang_command(cfg, "/models/m", 30001)
    assert sg[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(sg)
    for part in (
        "--model-path /models/m",
        "--tp-size 2",
        "--mem-fraction-static 0.6",
        "--enable-memory-saver",
        "--host 127.0.0.1",
        "--port 30001",
        "--dtype bfloat16",
    ):
        assert part in joined
    assert sg[-2:] == ["--foo", "1"]
    cpu = cpu_server_command(cfg, "/models/m", 30002)
    assert (
        cpu[1:3] == ["-m", "rayrl.engines.cpu"]
        and "--max-batch-size" in cpu
        and cpu[-2:] == ["--foo", "1"]
    )
    with pytest.raises(ValueError):
        EngineProcess(cfg, "/m", "/tmp/x.log", backend="tgi")
