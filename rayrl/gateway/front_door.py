"""The gateway's listening socket, served by a thread of its own that answers ``/health`` itself.

Why: with a thousand sessions in flight the gateway's event loop runs hundreds of callbacks per
iteration (requests parsed, chunks read, answers written); a ``/health`` request queued behind them
waited up to a second or more (bench/gateway_soak.py), although it needs nothing the loop holds. So the
front door owns the listener: it accepts every connection and peeks (``MSG_PEEK``: nothing is consumed)
at its first request line. A ``GET``/``HEAD`` of ``/health`` (or ``/``, Claude Code's connectivity check)
with no body is answered here, in this thread, and the connection stays here while it asks only that;
anything else, including a request line that has not fully arrived, is handed to the event loop
(``loop.connect_accepted_socket`` with the lean front's protocol, lean_front.py), which reads the
request from the start as if it had accepted the connection itself. The thread holds the GIL only for a peek and a short
write, so it needs no more than a few switch intervals (5 ms each) of the busy loop's time.

Each agent holds a keep-alive connection of its own, so a gateway with N sessions holds N descriptors
(plus one per LLM call at an engine). A soft ``RLIMIT_NOFILE`` of 1,024, a common default, would stop
accepting at about a thousand sessions (bench/session_capacity.py), so :meth:`FrontDoor.start` raises the
soft limit to ``min(hard, WANTED_FDS)`` as ``ray.init`` does for its own driver (a raylet started by ``ray
start``, and the standalone gateway, get no such raise), and says once when the hard limit is lower.

The answer stays meaningful: the event loop beats every ``BEAT_S`` (a timer on the loop); when the
last beat is older than ``stalled_s`` the loop is not serving and ``/health`` answers 503 with the
reason, as it does once the gateway is stopping. Otherwise 200 with the gateway's own status body and
``loop_lag_ms``, how long ago the loop last beat (at most about ``BEAT_S`` on a loop that keeps up).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import selectors
import socket
import threading
import time
from typing import Any, Callable

logger = logging.getLogger("rayrl.gateway")

BEAT_S = 0.1  # the event loop's heartbeat period
STALLED_S = 10.0  # no beat for this long: the loop is not serving, /health answers 503
ACCEPT_RETRY_S = 1.0  # accepting failed (out of descriptors, say): pause accepting this long, as asyncio does
IDLE_S = 75.0  # a keep-alive connection that asks nothing for this long is closed (aiohttp's default)
BACKLOG = 1024  # pending connections; a burst of agents connecting at once must not overflow it
_PEEK = 4096
WANTED_FDS = 65536  # open descriptors a gateway may hold: one per agent connection, one per call at an engine
LOW_FDS = 8192  # fewer than this after raising: said once, with what it caps
_HEALTH_PATHS = (b"/health", b"/")


def _health_request(head: bytes) -> tuple[bool, bool] | None:
    """(is HEAD, wants the connection closed) for a complete bodiless ``GET``/``HEAD``
    of a health path in ``head`` (the peeked bytes); None for anything the event loop must handle."""
    end = head.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = head[:end].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD") or parts[1] not in _HEALTH_PATHS:
        return None
    if parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        return None
    close = parts[2] == b"HTTP/1.0"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            return None
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0") or name == b"upgrade":
            return None
        if name == b"connection":
            close = b"close" in value if parts[2] == b"HTTP/1.1" else b"keep-alive" not in value
    return parts[0] == b"HEAD", close


class FrontDoor:
    """Accepts the gateway's connections in a thread; answers ``/health``; hands the rest to the loop.

    ``adopt(sock)`` runs on the event loop for each connection handed over; ``status()`` (called in this
    thread; it must only read) gives the body of a healthy answer."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop,
                 adopt: Callable[[socket.socket], None], status: Callable[[], dict[str, Any]]) -> None:
        self.sock = sock
        self.loop = loop
        self.adopt = adopt
        self.status = status
        self.stalled_s = STALLED_S
        self.answered = 0  # /health requests answered by this thread
        self.handed_over = 0  # connections handed to the event loop
        self.last_beat = time.monotonic()
        self.stopping = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._idle_since: dict[socket.socket, float] = {}
        self._beat: asyncio.TimerHandle | None = None
        self._accept_paused_until = 0.0
        self._stall_logged = False
        self._thread = threading.Thread(target=self._run, name="gateway-front-door", daemon=True)

    def start(self) -> None:
        """Start beating (on the loop: call from it) and accepting."""
        raise_fd_limit()
        self.sock.setblocking(False)
        self._wake_r.setblocking(False)
        self._selector.register(self.sock, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._on_beat()
        self._thread.start()

    def _on_beat(self) -> None:
        self.last_beat = time.monotonic()
        self._beat = self.loop.call_later(BEAT_S, self._on_beat)

    def stop(self) -> None:
        """Stop accepting, close the connections still here and the listener (from the loop)."""
        self.stopping = True
        if self._beat is not None:
            self._beat.cancel()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(10)
        self._wake_w.close()

    # -- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self.stopping:
                for key, _ in self._selector.select(timeout=1.0):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "conn":
                        self._serve(key.fileobj)  # type: ignore[arg-type]
                self._close_idle()
                if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    self._selector.register(self.sock, selectors.EVENT_READ, "accept")
        except Exception:  # a bug here must not leave the gateway without a listener unnoticed
            logger.exception("the gateway's front door failed; no new connections are accepted")
        finally:
            for conn in list(self._idle_since):
                self._drop(conn)
            self._selector.close()
            self._wake_r.close()
            self.sock.close()

    def _accept(self) -> None:
        for _ in range(64):  # a burst, without starving the connections already here
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of descriptors, say: logged once, accepting paused for a while
                logger.warning("gateway: accepting a connection failed (%s); retrying in %.0f s", err,
                               ACCEPT_RETRY_S)
                self._selector.unregister(self.sock)
                self._accept_paused_until = time.monotonic() + ACCEPT_RETRY_S
                return
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._idle_since[conn] = time.monotonic()
            self._selector.register(conn, selectors.EVENT_READ, "conn")

    def _serve(self, conn: socket.socket) -> None:
        """The connection has bytes (or was closed): answer a health request, or hand it over."""
        try:
            head = conn.recv(_PEEK, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not head:  # closed by the client
            self._drop(conn)
            return
        health = _health_request(head)
        if health is None:
            self._hand_over(conn)
            return
        is_head, close = health
        answer = self._answer(is_head, close)
        try:
            conn.recv(head.find(b"\r\n\r\n") + 4)  # consume exactly this request
            sent = conn.send(answer)  # a few hundred bytes: fits the socket buffer of a client that reads
        except OSError:
            sent = -1
        if sent != len(answer):  # a client that does not read its answers is not kept
            self._drop(conn)
            return
        self.answered += 1
        if close:
            self._drop(conn)
        else:
            self._idle_since[conn] = time.monotonic()

    def verdict(self) -> tuple[int, dict[str, Any]]:
        """The status code and body of a ``/health`` answer now (from any thread)."""
        lag = time.monotonic() - self.last_beat
        if self.stopping:
            return 503, {"status": "unavailable", "reason": "the gateway is stopping"}
        if lag > self.stalled_s:
            reason = f"the gateway's event loop has not run for {lag:.1f} s"
            if not self._stall_logged:  # once per stall
                self._stall_logged = True
                logger.warning("/health -> 503: %s", reason)
            return 503, {"status": "unavailable", "reason": reason}
        self._stall_logged = False
        try:
            return 200, {**self.status(), "loop_lag_ms": round(lag * 1e3, 1)}
        except Exception as err:  # the status itself failed: say so, do not claim health
            return 503, {"status": "unavailable", "reason": f"status failed: {type(err).__name__}"}

    def _answer(self, is_head: bool, close: bool) -> bytes:
        code, body = self.verdict()
        payload = json.dumps(body).encode()
        reason = b"OK" if code == 200 else b"Service Unavailable"
        head = (b"HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n"
                b"Connection: %s\r\n\r\n" % (code, reason, len(payload), b"close" if close else b"keep-alive"))
        return head if is_head else head + payload

    def _hand_over(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        del self._idle_since[conn]
        self.handed_over += 1
        try:
            self.loop.call_soon_threadsafe(self.adopt, conn)
        except RuntimeError:  # the loop is closed: nobody can serve it
            conn.close()

    def _drop(self, conn: socket.socket) -> None:
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        self._idle_since.pop(conn, None)
        conn.close()

    def _close_idle(self) -> None:
        cutoff = time.monotonic() - IDLE_S
        for conn in [c for c, since in self._idle_since.items() if since < cutoff]:
            self._drop(conn)


def raise_fd_limit(wanted: int = WANTED_FDS) -> int:
    """Raise this process's soft limit on open descriptors to ``min(hard, wanted)`` (never lowers it);
    returns the soft limit now. A limit still below ``LOW_FDS`` is logged: it caps the connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as err:
            logger.warning("gateway: could not raise the open-file limit from %d to %d: %s", soft, target, err)
    if soft != resource.RLIM_INFINITY and soft < min(wanted, LOW_FDS):
        logger.warning("gateway: at most %d open files (hard limit %s): about that many agent connections at "
                       "once; raise it with ulimit -n (docs/operations.md)", soft, hard)
    return soft


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port), as aiohttp's TCPSite would bind it."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock
