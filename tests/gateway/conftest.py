"""Gateway stacks for the tests: real HTTP servers on loopback, on a background event loop of the kind Ray hosts
the gateway on (uvloop when installed: rayrl/gateway/event_loop.py), so the tests check what training runs.

``tiny_stack``: the CPU engine serving the tiny random model (real token ids and log-probs, random
text), SmolLM2's tokenizer and chat template. ``scripted`` (a gateway in front of
tests/gateway/scripted_engine.py, for exact completions) is tests/conftest.py's, shared with the
environment tests; the stack itself is tests/gateway/stacks.py.
"""

from __future__ import annotations

import pytest

from rayrl.engines.router import Router
from rayrl.gateway.event_loop import new_event_loop as gateway_loop  # the loop Ray hosts the gateway on
from tests.gateway.stacks import Stack, gateway_for
from tests.loop_support import LoopThread


@pytest.fixture(scope="module")
def tiny_stack(tiny_model_dir, tiny_tokenizer):
    from rayrl.engines.cpu.engine import CPUEngine
    from rayrl.engines.cpu.server import EngineServer

    loop = LoopThread(gateway_loop)
    engine = CPUEngine(tiny_model_dir, dtype="float32", max_batch_size=8, context_length=4096).start()
    server = EngineServer(engine)
    url = loop.run(server.start())
    router = Router([url])
    gateway = gateway_for(tiny_tokenizer, router)
    loop.run(gateway.start())
    stack = Stack(loop, gateway, engine, router)
    yield stack
    stack.close_http()
    loop.run(gateway.stop())
    loop.run(router.close())
    loop.run(server.stop())
    engine.shutdown()
    loop.close()
