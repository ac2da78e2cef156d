"""The loop the gateway runs on (rayrl/gateway/event_loop.py): the one Ray makes for the GatewayShard
actor that hosts it, so the standalone host, the benches and the tests' gateway stacks run what training runs.
"""

from __future__ import annotations

import asyncio

import pytest
from ray._private import async_compat

from rayrl.gateway import event_loop


@pytest.mark.parametrize("setting", [None, "1", "true", "TRUE", "0", "false", "no"])
def test_the_gateway_loop_is_the_one_ray_makes_for_async_actors(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv("RAY_USE_UVLOOP", raising=False)
    else:
        monkeypatch.setenv("RAY_USE_UVLOOP", setting)
    ours, rays = event_loop.new_event_loop(), async_compat.get_new_event_loop()
    try:
        assert type(ours) is type(rays)
        assert event_loop.uses_uvloop() == (type(ours).__module__.startswith("uvloop"))
    finally:
        ours.close()
        rays.close()


def test_run_runs_the_coroutine_on_that_loop(monkeypatch):
    monkeypatch.delenv("RAY_USE_UVLOOP", raising=False)

    async def kind() -> type:
        return type(asyncio.get_running_loop())

    made = event_loop.new_event_loop()
    made.close()
    assert event_loop.run(kind()) is type(made)


def test_the_gateway_test_stacks_run_on_it(scripted):
    stack = scripted(lambda prompt: "Noted.")
    made = event_loop.new_event_loop()
    made.close()
    assert type(stack.loop.loop) is type(made)
    info = stack.open()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    answer = stack.http.post(stack.gateway.base_url + "/chat/completions",
                             headers={"Authorization": f"Bearer {info.token}"}, json=body)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "Noted."
    assert len(stack.gateway._lean) == 1  # the lean front serves it on this loop
