"""An OpenAI-compatible endpoint over a frozen model's engines: the judge a run serves (``rollout.judge.serve``).

rayrl's CPU engine speaks SGLang's native API (``/generate``), not Chat Completions; SGLang speaks both, but
a judge should not depend on the backend. So the run puts the gateway's own routes in front of the judge's
engines: the same rendering (the judge model's chat template), parsing and error answers as the policy's
gateway, over a router of the judge's engines only. Unlike the policy's gateway, it records nothing: every
call, whatever its API key, is answered in one built-in session that keeps no turn (``Gateway(record=False)``),
so nothing of the judge is ever trained on and a run-long stream of calls holds no memory. It binds loopback
by default: the rollout workers that ask it run on the driver's node, where actors/judge_server.py places it.

An engine failure is the gateway's usual 5xx answer; rayrl.rewards.judge.Judge retries it and then fails the
episode as ``judge_failed`` (an infrastructure failure, never a reward of 0).
"""

from __future__ import annotations

from typing import Any, Sequence

from rayrl.config import GatewayConfig, TrajectoryConfig


class FrozenEndpoint:
    """The Chat Completions (and Responses, Messages) routes over ``engine_urls``, recording nothing."""

    def __init__(self, model_path: str, engine_urls: Sequence[str], *, model_name: str, context_length: int,
                 host: str = "127.0.0.1", port: int = 0, wait_timeout_s: float = 600.0) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from rayrl.engines.router import Router
        from rayrl.gateway.app import Gateway

        self.router = Router(list(engine_urls), wait_timeout_s=wait_timeout_s)
        # the judge model's own family decides its parsers (auto), not the policy's gateway settings
        self.gateway = Gateway(GatewayConfig(host=host, port=port), TrajectoryConfig(),
                               AutoTokenizer.from_pretrained(model_path), self.router, model_name=model_name,
                               context_length=context_length,
                               model_type=getattr(AutoConfig.from_pretrained(model_path), "model_type", ""),
                               record=False)

    async def start(self, advertise_host: str | None = None) -> str:
        """Serve; returns the base URL (…/v1) that ``rollout.judge.base_url`` takes."""
        return await self.gateway.start(advertise_host=advertise_host)

    def stats(self) -> dict[str, Any]:
        """The gateway's counters (requests, errors, generated tokens) and the calls it answered."""
        session = self.gateway.unrecorded
        assert session is not None
        return {**self.gateway.counters, "calls": session.requests, "failed_calls": session.failed_requests}

    async def stop(self) -> None:
        await self.gateway.stop()
        await self.router.close()
