"""Gateway stacks for the tests: real HTTP servers on loopback, on a background event loop.

``tiny_stack``: the CPU engine serving the tiny random model (real token ids and log-probs, random
text). ``scripted``: a factory for a gateway in front of tests/gateway/scripted_engine.py, for tests
that need exact completions (tool calls). Both use SmolLM2's tokenizer and chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import httpx
import pytest

from rayrl.config import GatewayConfig, TrajectoryConfig
from rayrl.engines.router import Router
from rayrl.gateway.app import Gateway
from rayrl.gateway.sessions import SessionInfo
from tests.conftest import LoopThread
from tests.gateway.scripted_engine import ScriptedEngine


@dataclass
class Stack:
    loop: LoopThread
    gateway: Gateway
    engine: Any  # CPUEngine or ScriptedEngine
    router: Router

    def open(self, **metadata: Any) -> SessionInfo:
        return self.gateway.open_session(metadata)

    @property
    def root(self) -> str:
        return self.gateway.base_url[: -len("/v1")]

    @cached_property
    def http(self) -> httpx.Client:
        """One HTTP client for the test's plain requests (httpx's defaults, 5 s timeout): ``httpx.post`` builds
        a client, and its TLS context, each time (tens of ms). No cookies: the gateway sets none."""
        return httpx.Client()

    def close_http(self) -> None:
        if "http" in self.__dict__:
            self.http.close()

    def stats(self, info: SessionInfo) -> dict[str, Any]:
        session = self.gateway.sessions.get(info.session_id)
        return {**session.tree.stats(), "api_calls": session.api_calls, "cumulative_hits": session.cumulative_hits}


def _gateway(tokenizer: Any, router: Router, cfg: GatewayConfig | None = None, context_length: int = 4096,
             model_name: str = "tiny", chat_template: str | None = None) -> Gateway:
    return Gateway(cfg or GatewayConfig(tool_parser="hermes"), TrajectoryConfig(), tokenizer, router,
                   model_name=model_name, context_length=context_length, chat_template=chat_template)


@pytest.fixture(scope="module")
def tiny_stack(tiny_model_dir, tiny_tokenizer):
    from rayrl.engines.cpu.engine import CPUEngine
    from rayrl.engines.cpu.server import EngineServer

    loop = LoopThread()
    engine = CPUEngine(tiny_model_dir, dtype="float32", max_batch_size=8, context_length=4096).start()
    server = EngineServer(engine)
    url = loop.run(server.start())
    router = Router([url])
    gateway = _gateway(tiny_tokenizer, router)
    loop.run(gateway.start())
    stack = Stack(loop, gateway, engine, router)
    yield stack
    stack.close_http()
    loop.run(gateway.stop())
    loop.run(router.close())
    loop.run(server.stop())
    engine.shutdown()
    loop.close()


@pytest.fixture
def scripted(tiny_tokenizer):
    """``scripted(script, cfg=None, token_delay_s=0)`` -> Stack over a ScriptedEngine (SmolLM2's
    tokenizer unless ``tokenizer`` is given; ``chat_template``/``model_name`` go to the Gateway)."""
    smollm2 = tiny_tokenizer
    made: list[Stack] = []

    def make(script: Callable[[str], str], cfg: GatewayConfig | None = None, token_delay_s: float = 0.0,
             context_length: int = 8192, tokenizer: Any = None, chat_template: str | None = None,
             model_name: str = "tiny") -> Stack:
        tokenizer = tokenizer or smollm2
        loop = LoopThread()
        engine = ScriptedEngine(tokenizer, script, token_delay_s)
        url = loop.run(engine.start())
        router = Router([url])
        gateway = _gateway(tokenizer, router, cfg, context_length, model_name, chat_template)
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
