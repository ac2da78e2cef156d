"""Free TCP ports: the one helper every server we start (engines, the broadcast group's rendezvous,
local AgentCore, test servers) uses to pick its port.

Its own module so that the weight path and AgentCore need not import the engine launcher for it.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
