"""A gateway holds one descriptor per agent connection: started under a low soft ``RLIMIT_NOFILE`` (1,024
is a common default; here 128), its front door raises the soft limit toward the hard one, so more agents
than the old limit connect at once and each is answered. A real front door in a subprocess started with
the low limit, real sockets; no timing is asserted (bench/session_capacity.py holds 10,000 sessions)."""

from __future__ import annotations

import resource
import selectors
import socket
import subprocess
import sys
import time

import pytest

LOW = 128
CONNECTIONS = 300

CHILD = """
import asyncio, resource
from rayrl.gateway import front_door

async def main():
    sock = front_door.bind("127.0.0.1", 0)
    door = front_door.FrontDoor(sock, asyncio.get_running_loop(), lambda conn: conn.close(),
                                lambda: {"status": "ok"})
    door.start()
    print(sock.getsockname()[1], resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _low_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def _answers(conns: list[socket.socket], deadline_s: float) -> list[bytes]:
    """The first bytes each connection answers within ``deadline_s`` in all (one not accepted never does)."""
    sel = selectors.DefaultSelector()
    for conn in conns:
        sel.register(conn, selectors.EVENT_READ)
    got, end = [], time.monotonic() + deadline_s
    while len(got) < len(conns) and time.monotonic() < end:
        for key, _ in sel.select(timeout=max(0.0, end - time.monotonic())):
            got.append(key.fileobj.recv(4096))
            sel.unregister(key.fileobj)
    sel.close()
    return got


def test_front_door_raises_a_low_descriptor_limit_and_serves_past_it():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2 * CONNECTIONS + 64:
        pytest.skip(f"hard open-file limit {hard} leaves no room above the low one")
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             preexec_fn=_low_limit)
    conns: list[socket.socket] = []
    try:
        port, soft = map(int, child.stdout.readline().split())
        assert soft > CONNECTIONS + 64  # raised from LOW
        for _ in range(CONNECTIONS):  # every agent holds its connection open
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=20))
        for conn in conns:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = _answers(conns, deadline_s=15.0)
        assert len(answers) == CONNECTIONS and all(a.startswith(b"HTTP/1.1 200") for a in answers)
    finally:
        for conn in conns:
            conn.close()
        child.kill()
        child.wait(10)
