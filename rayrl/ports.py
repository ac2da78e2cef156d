"""Free TCP ports: the one helper every server we start (engines, the trainer's and the broadcast group's
rendezvous, local AgentCore, test servers) uses to pick its port.

A port is picked in one process and bound later in another, often many seconds later (an SGLang server
binds after loading its model). Two things could take it in between, and the server would then die on
"address already in use":

- any outgoing connection on the node (Ray's gRPC, NCCL, an HTTP client): its local port comes from the
  kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), which is also where ``bind(0)``
  draws from. So picks come from outside that range (from 20000, above Ray's default worker ports
  10002-19999, up to the range, and above it), where only explicit binds land;
- another process picking at the same moment (eight engine actors starting on one node). So each pick is
  claimed for the picking process in a per-user directory, and a port claimed by a live process is never
  handed out again; a dead process's claims are taken over.

Where no port lies outside the ephemeral range, or no claim can be written, the OS picks (``bind(0)``).

Its own module so that the weight path and AgentCore need not import the engine launcher for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path
from typing import Iterator

FIRST_PORT = 20000  # above Ray's default worker ports (min/max_worker_port 10002-19999)
LAST_PORT = 65535
ATTEMPTS = 64
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default
# the OS's randomness: a run that seeds `random` in every process would otherwise draw the same ports
# everywhere, and picking a port would move the run's own random stream
_RNG = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default where unreadable)."""
    try:
        low, high = (int(part) for part in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return low, high


def candidate_spans() -> list[range]:
    """The ports a pick draws from: from FIRST_PORT to LAST_PORT, less the ephemeral range."""
    low, high = ephemeral_range()
    spans = [range(FIRST_PORT, min(low, LAST_PORT + 1)), range(max(high + 1, FIRST_PORT), LAST_PORT + 1)]
    return [span for span in spans if len(span)]


def claims_dir() -> Path:
    """Where claims live: one file per claimed port, holding the claiming process's pid."""
    return Path(tempfile.gettempdir()) / f"rayrl-ports-{os.getuid()}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the ephemeral range, and claimed for this process."""
    spans = candidate_spans()
    total = sum(len(span) for span in spans)
    for _ in range(ATTEMPTS if total else 0):
        index = _RNG.randrange(total)
        for span in spans:
            if index < len(span):
                port = span[index]
                break
            index -= len(span)
        claimed = claim(port)
        if claimed is False:
            continue
        if bindable(host, port):
            return port
        if claimed:
            release(port)
    return _os_pick(host)


def bindable(host: str, port: int) -> bool:
    """True when a listening socket could bind ``host:port`` now (no SO_REUSEADDR: a port still in
    TIME_WAIT counts as taken, as it does for a server that does not set it)."""
    with _socket_for(host) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def claim(port: int) -> bool | None:
    """Claim ``port`` for this process: True when claimed, False when a live process holds it, None when
    claims cannot be written here (the bind test alone then guards the pick)."""
    try:
        with _claims_locked() as directory:
            path = directory / str(port)
            if path.exists():
                if _owner_alive(path):
                    return False
                path.unlink()
            path.write_text(str(os.getpid()))
    except OSError:
        return None
    return True


def release(port: int) -> None:
    """Give back a claim this process holds (one it does not hold is left alone)."""
    with contextlib.suppress(OSError), _claims_locked() as directory:
        path = directory / str(port)
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()


@contextlib.contextmanager
def _claims_locked() -> Iterator[Path]:
    """The claims directory under its lock: checking a claim and writing one are one step across
    processes (two pickers could otherwise both take over the same dead claim)."""
    directory = claims_dir()
    directory.mkdir(mode=0o700, exist_ok=True)
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield directory


def _owner_alive(path: Path) -> bool:
    """Whether the process that wrote the claim lives. Claims are written under the lock, so an empty or
    garbled one is from a process that died mid-write: stale."""
    try:
        pid = int(path.read_text().strip())
    except ValueError:
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # lives, under another user
        return True
    return True


def _os_pick(host: str) -> int:
    with _socket_for(host) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _socket_for(host: str) -> socket.socket:
    """A TCP socket of ``host``'s address family (IPv6 where it has a colon)."""
    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
