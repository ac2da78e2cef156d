"""Bad input never breaks the gateway: every operation of its OpenAPI spec, fuzzed with hypothesis.

For each operation in ``GET /openapi.json``: raw junk bodies, non-object JSON, and the operation's
example body with random mutations (fields deleted, values replaced by arbitrary JSON of any type,
nested values swapped). Every answer must be a 2xx or a 4xx with a JSON error body in the route's
dialect: never a 5xx, never a hang or crash. Afterwards an untouched session still works and its
trajectory is intact. Also: the spec lists exactly the app's routes, oversized bodies get a JSON 413,
and explicit invalid tool schemas are refused with 400. Bounded: 40 examples per operation.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayrl.config import GatewayConfig
from rayrl.gateway.openapi import EXAMPLES, openapi_spec

EXAMPLES_PER_OPERATION = 40

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                      st.text(max_size=12))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                          max_leaves=8)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated(draw, example: dict) -> dict:
    body = json.loads(json.dumps(example))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(body) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["delete", "replace", "replace"]))
        if action == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_value)
    return body


def _operations() -> list[tuple[str, str]]:
    spec = openapi_spec()
    return [(m, p) for p, ops in spec["paths"].items() for m in ops if m == "post"]


@pytest.fixture
def stack(scripted):
    return scripted(lambda prompt: 'ok <tool_call>{"name": "calc", "arguments": {"e": "1"}}</tool_call>')


def _url_and_headers(stack, path: str, token: str, sid: str) -> tuple[str, dict]:
    url = stack.root + path.replace("{session_id}", sid)
    if path.startswith("/rayrl/"):
        return url, {"Authorization": f"Bearer {stack.gateway.admin_token}"}
    return url, {"Authorization": f"Bearer {token}", "x-api-key": token}


def _check(resp: httpx.Response, path: str) -> None:
    assert resp.status_code < 500, (path, resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        body = resp.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and isinstance(body["error"]["message"], str)
        else:
            assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    elif "text/event-stream" not in resp.headers.get("content-type", ""):
        resp.json()


@pytest.mark.parametrize("method,path", _operations())
def test_fuzz_operation(stack, method, path):
    keeper = stack.open(role="bystander")
    bystander = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(stack.root + "/v1/chat/completions", json=bystander,
                   headers={"Authorization": f"Bearer {keeper.token}"})
    assert r.status_code == 200
    example = EXAMPLES[(method, path)]
    victim = stack.open(role="fuzzed")
    statuses: list[int] = []

    @settings(max_examples=int(os.environ.get("RAYRL_FUZZ_EXAMPLES", EXAMPLES_PER_OPERATION)), deadline=None,
              derandomize=os.environ.get("RAYRL_FUZZ_RANDOM") is None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(case=st.one_of(
        st.builds(lambda b: ("raw", b), st.binary(max_size=64)),
        st.builds(lambda v: ("json", v), json_value),
        st.builds(lambda b: ("json", b), mutated(example)),
    ))
    def run(case):
        kind, payload = case
        # finishing ends a session: each finish example gets a fresh one
        sid = victim.session_id if path != "/rayrl/sessions/{session_id}/finish" else stack.open().session_id
        url, headers = _url_and_headers(stack, path, victim.token, sid)
        body = payload if kind == "raw" else json.dumps(payload)
        resp = client.post(url, content=body, headers={**headers, "Content-Type": "application/json"})
        _check(resp, path)
        statuses.append(resp.status_code)

    # one client for every example: a fresh one each (httpx.post) spent most of the time building its TLS context
    with httpx.Client(timeout=30) as client:
        run()
    # the mutations reach both sides of validation: some requests pass, some are refused
    assert any(c < 300 for c in statuses) and any(400 <= c < 500 for c in statuses), sorted(set(statuses))
    assert stack.gateway.counters["errors_internal"] == 0
    # the bystander is unaffected: its history still extends exactly, its tree has its one turn + this one
    again = {"messages": bystander["messages"] + [r.json()["choices"][0]["message"],
                                                  {"role": "user", "content": "more"}],
             "max_tokens": 4}
    r2 = httpx.post(stack.root + "/v1/chat/completions", json=again,
                    headers={"Authorization": f"Bearer {keeper.token}"})
    assert r2.status_code == 200
    stats = stack.stats(keeper)
    assert stats["turns"] == 2 and stats["cumulative_hits"] == 1


def test_spec_matches_routes(stack):
    spec_ops = {(m.upper(), p) for p, ops in openapi_spec()["paths"].items() for m in ops}
    app_ops = {(r.method, r.resource.canonical) for r in stack.gateway.app.router.routes() if r.method != "HEAD"}
    assert spec_ops == app_ops
    served = httpx.get(stack.root + "/openapi.json").json()
    assert served == openapi_spec()


def test_oversized_body_gets_json_413(scripted):
    stack = scripted(lambda p: "ok", cfg=GatewayConfig(tool_parser="hermes", max_body_mb=0.01))
    info = stack.open()
    big = {"messages": [{"role": "user", "content": "x" * 20_000}]}
    for url, headers in [(info.base_url + "/chat/completions", {"Authorization": f"Bearer {info.token}"}),
                         (stack.root + "/v1/messages", {"x-api-key": info.token}),
                         (info.base_url + "/responses", {"Authorization": f"Bearer {info.token}"})]:
        r = httpx.post(url, json=big, headers=headers)
        assert r.status_code == 413, r.text
        assert "MB" in (r.json()["error"]["message"])


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "", "parameters": {}}]}),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": [1]}]}),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"name": "f", "input_schema": "object"}]}),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"input_schema": {}}]}),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
])
def test_invalid_tool_schemas_and_options_are_400(stack, path, body):
    info = stack.open()
    r = httpx.post(stack.root + path, json=body, headers={"Authorization": f"Bearer {info.token}"})
    assert r.status_code == 400, r.text
