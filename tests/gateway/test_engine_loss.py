"""A gateway call whose engine dies keeps every token already generated, streamed to the agent or not.

Two real CPU engine server processes (the tiny model; weight versions 1 and 2, so each token's policy
version says which engine made it) behind a real gateway; an agent calls Chat Completions with the real
openai SDK, and the engine its session is routed to is SIGKILLed once it has generated some tokens. The
gateway streams from the engines internally, so the call goes on on the other engine from every token
received: the answer is whole, and the recorded turn (and the training sample made from it) holds the
killed engine's tokens, then the survivor's, with the log-probs the agent was sent.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from rayrl.config import GatewayConfig, TrajectoryConfig
from rayrl.engines.launcher import EngineProcess
from rayrl.engines.router import Router
from rayrl.gateway.app import Gateway
from rayrl.gateway.event_loop import new_event_loop as gateway_loop  # the loop Ray hosts it on
from tests.engine_kill import kept_and_continued, kill_after_tokens
from tests.engine_procs import start_together
from tests.loop_support import LoopThread

N = 400  # tokens per call: far more than are generated before the kill
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


@pytest.fixture
def stack(two_engines, tiny_tokenizer):
    """Both engines up (the test before killed one), a fresh router and gateway in front of them."""
    start_together(two_engines)
    loop = LoopThread(gateway_loop)
    router = Router([p.url for p in two_engines])
    gateway = Gateway(GatewayConfig(tool_parser="hermes"), TrajectoryConfig(),
                      tiny_tokenizer, router, model_name="tiny")
    loop.run(gateway.start())
    yield loop, gateway, router
    loop.run(gateway.stop())
    loop.run(router.close())
    loop.close()


def _call(loop: LoopThread, gateway: Gateway, router: Router, engines: list[EngineProcess],
          stream: bool) -> tuple[Any, str, list[float], Any, EngineProcess, EngineProcess]:
    """One call whose engine is killed mid-generation: (session, answer text, the log-probs the agent
    received, finish reason, victim, survivor)."""
    info = gateway.open_session({"test": "engine-loss"})
    by_url = {p.url: p for p in engines}
    victim = by_url[router.ranking(info.session_id)[0]]
    survivor = next(p for p in engines if p is not victim)
    killer = asyncio.run_coroutine_threadsafe(kill_after_tokens(victim), loop.loop)
    client = openai.OpenAI(base_url=info.base_url, api_key=info.token, max_retries=0, timeout=300)
    request = dict(model="tiny", messages=MESSAGES, max_tokens=N, temperature=0.0, logprobs=True)
    if stream:
        text, logprobs, finish = [], [], None
        for chunk in client.chat.completions.create(**request, stream=True):
            choice = chunk.choices[0]
            text.append(choice.delta.content or "")
            logprobs += [e.logprob for e in (choice.logprobs.content if choice.logprobs else None) or []]
            finish = choice.finish_reason or finish
        answer = "".join(text)
    else:
        out = client.chat.completions.create(**request)
        answer, finish = out.choices[0].message.content, out.choices[0].finish_reason
        logprobs = [e.logprob for e in out.choices[0].logprobs.content]
        assert out.usage.completion_tokens == N
    killer.result(60)
    return gateway.sessions.get(info.session_id), answer, logprobs, finish, victim, survivor


def _check_recorded(loop: LoopThread, gateway: Gateway, router: Router, session: Any, answer: str,
                    logprobs: list[float], finish: Any, victim: EngineProcess, survivor: EngineProcess) -> None:
    assert router.routed["lost_continued"] == 1  # the call went on on the survivor, once
    assert finish == "length"  # whole: it ran to max_tokens, nothing was cut
    turn = session.recent[-1]
    assert len(session.recent) == 1 and len(turn.response_ids) == N
    kept = kept_and_continued(turn.policy_version.tolist(), victim, survivor)
    assert 24 <= kept < N  # the tokens generated before the kill were kept, not generated again
    # token-faithful: the agent got the recorded answer and the recorded log-probs, every token once
    assert answer == turn.response_message["content"]
    assert logprobs == turn.response_logprobs.tolist()
    # the survivor, run alone from the same prompt, makes the same first tokens (same weights, greedy)
    alone = loop.run(router.generate(f"reference-{session.session_id}", turn.prompt_ids,
                                     {"max_new_tokens": kept, "temperature": 0.0, "ignore_eos": True}))
    assert alone.output_ids.tolist() == turn.response_ids[:kept].tolist()
    samples = loop.run(gateway.finish_session(session.session_id, reward=1.0))
    (sample,) = samples
    assert sample.tokens[sample.prompt_length:].tolist() == turn.response_ids.tolist()
    assert sample.loss_mask.tolist() == [1] * N
    assert sample.policy_versions.tolist() == turn.policy_version.tolist()
    assert sample.rollout_logprobs.tolist() == turn.response_logprobs.tolist()


def test_a_plain_call_keeps_its_tokens_when_its_engine_dies(stack, two_engines):
    loop, gateway, router = stack
    session, answer, logprobs, finish, victim, survivor = _call(loop, gateway, router, two_engines, stream=False)
    _check_recorded(loop, gateway, router, session, answer, logprobs, finish, victim, survivor)


@pytest.mark.slow  # ~11 s, two engines started again; fast twin: the plain call above (the same internal stream)
def test_a_streamed_call_keeps_its_tokens_when_its_engine_dies(stack, two_engines):
    loop, gateway, router = stack
    session, answer, logprobs, finish, victim, survivor = _call(loop, gateway, router, two_engines, stream=True)
    _check_recorded(loop, gateway, router, session, answer, logprobs, finish, victim, survivor)
