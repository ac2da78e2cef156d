"""The host-side filtering HTTP proxy that is a sandbox's only way out when ``allowed_hosts`` is set.

The sandbox keeps its own network namespace (loopback only, no route anywhere). Its single exit is a
unix socket in the sandbox directory, bind-mounted inside, behind which this proxy listens: HTTP
``CONNECT host:port`` (HTTPS and any TCP tunnel) and plain HTTP requests with an absolute URI. Each
request's host is checked against the sandbox's :class:`~rayrl.sandboxes.netpolicy.HostPolicy`, resolved
*here* (the sandbox has no DNS), and every resolved address is checked again (no rebinding to loopback or
private addresses). Denials get a 403 with a body that says why, are counted, and are logged once per
host and port.

One asyncio loop on one daemon thread serves the proxies of every sandbox this process owns (the pool
actor owns many): a proxy is a unix-socket server on that loop, started with the sandbox and stopped by
its ``close()``, which also aborts its open connections. The thread dies with the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Awaitable
from concurrent.futures import Future
from typing import Any, TypeVar
from urllib.parse import urlsplit

from rayrl.sandboxes.netpolicy import HostPolicy, literal_address, normalise_host

logger = logging.getLogger(__name__)

_HEAD_LIMIT = 64 * 1024  # request line + headers
_HEAD_TIMEOUT_S = 30.0  # a client that does not send its request head in time is dropped
_CONNECT_TIMEOUT_S = 10.0
_RELAY_CHUNK = 64 * 1024
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate",
               "te", "trailer", "upgrade"}
_UNIX_PATH_MAX = 107
_MAX_CONNECTIONS = 256  # per sandbox: sandboxed code must not exhaust the owner's file descriptors

T = TypeVar("T")


class _Loop:
    """The process-wide proxy loop, started on first use (and again after a fork)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _pid = -1

    @classmethod
    def run(cls, coro: Awaitable[T], timeout: float = 30.0) -> T:
        future: Future = asyncio.run_coroutine_threadsafe(coro, cls._get())  # type: ignore[arg-type]
        return future.result(timeout)

    @classmethod
    def _get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="rayrl-sandbox-proxy", daemon=True).start()
                cls._loop, cls._pid = loop, os.getpid()
            return cls._loop


class SandboxProxy:
    """One sandbox's filtering proxy, listening on ``socket_path`` (see the module docstring)."""

    def __init__(self, socket_path: str, policy: HostPolicy, name: str, owner_uid: int | None = None) -> None:
        if len(socket_path.encode()) > _UNIX_PATH_MAX:
            raise ValueError(f"proxy socket path too long for a unix socket ({socket_path}); "
                             "choose a shorter sandbox root")
        self.socket_path = socket_path
        self.policy = policy
        self.name = name
        self.counts = {"allowed": 0, "denied": 0, "failed": 0, "bad_requests": 0, "over_limit": 0}
        self._denied_logged: set[tuple[str, int]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None
        self._closed = False
        _Loop.run(self._start(owner_uid))

    def stats(self) -> dict[str, int]:
        """Connections allowed and denied so far (plus upstream failures, malformed requests, and
        connections refused because too many were open)."""
        return dict(self.counts)

    def drop_connections(self) -> None:
        """Abort every open connection (the sandbox was reset: nothing of the last lease may linger)."""
        if not self._closed:
            _Loop.run(self._abort_all())

    def close(self) -> None:
        """Stop listening, abort open connections, remove the socket; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        _Loop.run(self._stop())
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------------------------ on the loop
    async def _start(self, owner_uid: int | None) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.socket_path, limit=_HEAD_LIMIT)
        if owner_uid is not None:
            os.chown(self.socket_path, owner_uid, owner_uid)
        os.chmod(self.socket_path, 0o600)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._abort_all()

    async def _abort_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._writers) >= _MAX_CONNECTIONS:
            self.counts["over_limit"] += 1
            if self.counts["over_limit"] == 1:
                logger.warning("sandbox %s: more than %d proxy connections at once; refusing the rest",
                               self.name, _MAX_CONNECTIONS)
            writer.transport.abort()
            return
        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            upstream = await self._handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        except Exception:  # a proxy bug must not take the loop down; it is logged with its traceback
            logger.exception("sandbox %s: proxy connection failed", self.name)
        finally:
            self._writers.discard(writer)
            for w in (writer, upstream):
                if w is not None:
                    w.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> asyncio.StreamWriter | None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _HEAD_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            await self._reply(writer, 431, "request headers too large", bad=True)
            return None
        except (asyncio.TimeoutError, asyncio.IncompleteReadError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            await self._reply(writer, 400, "expected an HTTP/1.x proxy request", bad=True)
            return None
        method, target, _ = parts
        if method == "CONNECT":
            host, port = _split_authority(target)
            if host is None or port is None:
                await self._reply(writer, 400, f"CONNECT needs host:port, got {target!r}", bad=True)
                return None
        else:
            url = urlsplit(target)
            if url.scheme != "http" or not url.hostname:
                await self._reply(writer, 400, "expected an absolute http:// URI (use CONNECT for https)",
                                  bad=True)
                return None
            try:
                host, port = url.hostname, url.port or 80
            except ValueError:
                await self._reply(writer, 400, f"bad port in {target!r}", bad=True)
                return None
        host = normalise_host(host)
        upstream_reader, upstream = await self._open(writer, host, port)
        if upstream is None:
            return None
        self.counts["allowed"] += 1
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            upstream.write(_origin_form(lines, urlsplit(target)))
        await _relay(reader, writer, upstream_reader, upstream)
        return upstream

    async def _open(self, writer: asyncio.StreamWriter, host: str,
                    port: int) -> tuple[asyncio.StreamReader | None, asyncio.StreamWriter | None]:
        """Policy check, host-side resolution, address check, connect; or a reply saying why not."""
        where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        if self.policy.rule_for(host, port) is None:
            await self._deny(writer, host, port, f"{where} is not in sandbox.allowed_hosts")
            return None, None
        literal = literal_address(host)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as err:
                self.counts["failed"] += 1
                await self._reply(writer, 502, f"cannot resolve {host}: {err}")
                return None, None
            addresses = list(dict.fromkeys(literal_address(info[4][0]) for info in infos))
            addresses = [a for a in addresses if a is not None]
        usable = [a for a in addresses if self.policy.address_allowed(a, port)]
        if not usable:
            shown = ", ".join(str(a) for a in addresses)
            await self._deny(writer, host, port, f"{where} resolves to {shown}, a non-public address that no "
                                                 "allowed_hosts entry names literally")
            return None, None
        last: Exception | None = None
        for address in usable:
            try:
                return await asyncio.wait_for(asyncio.open_connection(str(address), port), _CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError) as err:
                last = err
        self.counts["failed"] += 1
        await self._reply(writer, 502, f"cannot connect to {where}: {last or 'timed out'}")
        return None, None

    async def _deny(self, writer: asyncio.StreamWriter, host: str, port: int, why: str) -> None:
        self.counts["denied"] += 1
        if (host, port) not in self._denied_logged:
            self._denied_logged.add((host, port))
            logger.warning("sandbox %s: network access denied: %s", self.name, why)
        await self._reply(writer, 403, why)

    async def _reply(self, writer: asyncio.StreamWriter, status: int, message: str,
                     bad: bool = False) -> None:
        if bad:
            self.counts["bad_requests"] += 1
        reason = {400: "Bad Request", 403: "Forbidden", 431: "Request Header Fields Too Large",
                  502: "Bad Gateway"}[status]
        body = f"rayrl sandbox proxy: {message}\n".encode()
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        try:
            await writer.drain()
        except ConnectionError:
            pass


def _split_authority(target: str) -> tuple[str | None, int | None]:
    """``host:port`` or ``[v6]:port`` of a CONNECT request."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host or not 1 <= int(port) <= 65535:
        return None, None
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return None, None
    return host, int(port)


def _origin_form(lines: list[str], url: Any) -> bytes:
    """The request head rewritten for the origin server: path-only target, no hop-by-hop headers,
    ``Connection: close`` (one request per proxied connection keeps the relay a plain byte pipe)."""
    method, _, version = lines[0].split(" ")
    path = url.path or "/"
    if url.query:
        path += "?" + url.query
    out = [f"{method} {path} {version}"]
    has_host = False
    for line in lines[1:]:
        if not line:
            continue
        name = line.split(":", 1)[0].strip().lower()
        if name in _HOP_BY_HOP:
            continue
        has_host = has_host or name == "host"
        out.append(line)
    if not has_host:
        out.append(f"Host: {url.netloc}")
    out.append("Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_RELAY_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()


async def _relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                 up_r: asyncio.StreamReader, up_w: asyncio.StreamWriter) -> None:
    """Copy bytes both ways until both sides have finished."""
    await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))
