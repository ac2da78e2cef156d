"""Fixtures of the environment tests: the scripted gateway stacks of tests/gateway, and a judge endpoint."""

import pytest

from tests.conftest import LoopThread
from tests.environments.judge_server import JudgeServer
from tests.gateway.conftest import scripted  # noqa: F401


@pytest.fixture
def judge_server():
    loop = LoopThread()
    made: list[JudgeServer] = []

    def make(reply=lambda prompt: "yes") -> JudgeServer:
        server = JudgeServer(reply)
        loop.run(server.start())
        made.append(server)
        return server

    yield make
    for server in made:
        loop.run(server.stop())
    loop.close()
