"""Fixtures of the environment tests: a judge endpoint (the scripted gateway stacks: tests/conftest.py)."""

import pytest

from tests.environments.judge_server import JudgeServer
from tests.loop_support import LoopThread


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
