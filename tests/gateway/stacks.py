"""A gateway stack for the tests: a gateway and a router in front of one engine, on a background loop
(the fixtures ``tiny_stack``, tests/gateway/conftest.py, and ``scripted``, tests/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import httpx

from rayrl.config import GatewayConfig, TrajectoryConfig
from rayrl.engines.router import Router
from rayrl.gateway.app import Gateway
from rayrl.gateway.sessions import SessionInfo
from tests.loop_support import LoopThread


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


def gateway_for(tokenizer: Any, router: Router, cfg: GatewayConfig | None = None, context_length: int = 4096,
             model_name: str = "tiny", chat_template: str | None = None) -> Gateway:
    return Gateway(cfg or GatewayConfig(tool_parser="hermes"), TrajectoryConfig(), tokenizer, router,
                   model_name=model_name, context_length=context_length, chat_template=chat_template)
