"""The engine interface is one typed protocol (rayrl/engines/api.py): EngineClient implements it call for
call, the CPU engine's real server serves every route of it and its own extra routes, and every other
path the client calls is a backend's declared extra route. SGLang's side of the same routes is held by
tests/contracts/test_sglang_contract.py."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from rayrl.engines import client as client_module
from rayrl.engines.api import ROUTES, EngineAPI
from rayrl.engines.backends import BACKENDS
from rayrl.engines.client import EngineClient
from rayrl.engines.cpu.server import EngineServer


def _protocol_methods() -> list[str]:
    return [name for name, value in vars(EngineAPI).items()
            if inspect.iscoroutinefunction(value) and not name.startswith("_")]


def test_engine_client_implements_the_protocol_call_for_call():
    methods = _protocol_methods()
    assert len(methods) >= 20
    for name in methods:
        ours = inspect.signature(getattr(EngineClient, name))
        spec = inspect.signature(getattr(EngineAPI, name))
        assert list(ours.parameters) == list(spec.parameters), name
        for param in spec.parameters.values():
            theirs = ours.parameters[param.name]
            assert (theirs.kind, theirs.default) == (param.kind, param.default), (name, param.name)
    public = {n for n, v in vars(EngineClient).items() if inspect.iscoroutinefunction(v) and not n.startswith("_")}
    assert public == set(methods), "EngineClient's calls and the protocol differ"


def test_every_path_the_client_calls_is_a_route_or_a_declared_extension():
    sent = set(re.findall(r'"(/[a-z0-9_/]+)"', Path(client_module.__file__).read_text()))
    extras = {path for backend in BACKENDS.values() for path in backend.extra_routes}
    assert sent == set(ROUTES) | extras
    assert not extras & set(ROUTES)


def test_the_cpu_engine_serves_every_route_with_its_method(engine):
    server = EngineServer(engine)
    served = {(route.method, route.resource.canonical) for route in server.app.router.routes()}
    for path, method in {**ROUTES, **BACKENDS["cpu"].extra_routes}.items():
        assert (method, path) in served, (method, path)
