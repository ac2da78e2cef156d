"""A lean HTTP/1.1 client for the router's streaming ``/generate`` calls, the gateway's hot path.

Why not aiohttp's client (which the rest of rayrl uses): every LLM call of every agent goes through this
path, and aiohttp builds each request through cookie jars, header merging, URL objects, tracing hooks and
timeouts meant for arbitrary servers. The engines are known servers on a private network (SGLang or the
CPU engine) and the request is always the same shape: a JSON ``POST`` answered by a server-sent event
stream. Written straight onto asyncio streams, a call costs about 40% less CPU (measured against the
overhead bench's stub: bench/gateway_profile.py), which the gateway's throughput is bound by.

What it does: keep-alive connections pooled per engine (a connection the server has closed is never
reused; idle ones are closed after ``idle_s``); ``Content-Length``, chunked and read-to-close bodies;
a timeout on each read (``read_timeout_s``: a stream may run long, but never stall that long) and on
connecting. Failures are :class:`StreamHTTPError` saying whether a connection was made at all
(``connect_failed``: the request surely did not run), and whether the wait timed out; anything else is a
connection that broke (``connection_lost``).
"""

from __future__ import annotations

import asyncio
from typing import Optional

_MAX_HEAD = 65536  # status line + headers


class StreamHTTPError(Exception):
    def __init__(self, message: str, connect_failed: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.connect_failed = connect_failed
        self.timed_out = timed_out


def _host_port(url: str) -> tuple[str, int]:
    """``http://host:port`` (``[v6]:port`` too; port 80 when absent) -> (host, port)."""
    if not url.startswith("http://"):
        raise ValueError(f"only http:// engine URLs are supported, not {url!r}")
    netloc = url[7:].split("/", 1)[0]
    if netloc.startswith("["):
        host, _, rest = netloc[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else 80
    host, _, port = netloc.partition(":")
    return host, int(port) if port else 80


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0
        self.deadline = 0.0  # loop time by which the pending read must make progress
        self.timed_out = False
        self.armed = False  # a request is being answered on it (idle in the pool: False)
        self._watchdog: Optional[asyncio.TimerHandle] = None

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing() or self.reader.exception() is not None)

    def arm(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        """Start watching reads. One timer per connection, kept across its requests: a timer that fires
        before the deadline (moved on by every read, and by the next request) is set again for it, and one
        that fires while the connection is idle in the pool lapses (the next request starts another). So a
        request on a reused connection schedules and cancels no timer of its own."""
        self.timed_out = False
        self.armed = True
        self.deadline = loop.time() + timeout_s
        if self._watchdog is None:
            self._watchdog = loop.call_at(self.deadline, self._check, loop)

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.armed:
            self._watchdog = None
            return
        if loop.time() < self.deadline:
            self._watchdog = loop.call_at(self.deadline, self._check, loop)
            return
        self._watchdog = None
        self.timed_out = True
        self.writer.transport.abort()  # the pending read fails at once

    def disarm(self) -> None:
        """Stop watching reads (the timer, if any, lapses when it fires)."""
        self.armed = False

    def close(self) -> None:
        self.armed = False
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self.writer.transport.abort()


class StreamResponse:
    """One response: ``status``, then :meth:`next_block` until it returns None (or :meth:`read`)."""

    def __init__(self, client: "StreamingHTTP", key: tuple[str, int], conn: _Connection, status: int,
                 chunked: bool, length: Optional[int], keep_alive: bool) -> None:
        self._client, self._key, self._conn = client, key, conn
        self.status = status
        self._chunked, self._left, self._keep_alive = chunked, length, keep_alive
        self.complete = False
        self._raw = b""  # chunked: bytes received and not decoded yet
        self._in_chunk = 0  # chunked: payload bytes of the current chunk still to come
        self._crlf = False  # chunked: the CRLF after a chunk's payload is due
        self._trailers = False  # chunked: the last chunk came; trailer lines until a blank one

    async def next_block(self) -> Optional[bytes]:
        """The next piece of the body as it arrives (everything decodable from one read); None at its end."""
        if self.complete:
            return None
        reader, conn = self._conn.reader, self._conn
        conn.deadline = asyncio.get_running_loop().time() + self._client.read_timeout_s
        try:
            if self._chunked:
                while True:
                    block = self._dechunk()
                    if block or self.complete:
                        return block or None
                    data = await reader.read(262144)
                    if not data:
                        raise asyncio.IncompleteReadError(self._raw, None)
                    self._raw += data
            if self._left is not None:
                if self._left <= 0:
                    self.complete = True
                    return None
                block = await reader.read(min(self._left, 262144))
                if not block:
                    raise asyncio.IncompleteReadError(b"", self._left)
                self._left -= len(block)
                return block
            block = await reader.read(262144)  # no length: the body ends when the server closes
            if not block:
                self.complete, self._keep_alive = True, False
                return None
            return block
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ValueError) as err:
            raise self._client.failure(conn, err) from None

    def _dechunk(self) -> bytes:
        """Decode as much of the chunked framing in ``_raw`` as has arrived; the payload bytes so far."""
        raw, pos, out = self._raw, 0, []
        have = len(raw)
        while True:
            if self._in_chunk:
                end = pos + self._in_chunk
                if end + 2 <= have:  # the rest of the payload and its CRLF have arrived: one slice
                    if raw[end:end + 2] != b"\r\n":
                        raise ValueError("a chunk did not end with CRLF")
                    out.append(raw[pos:end])
                    pos, self._in_chunk = end + 2, 0
            if self._in_chunk:
                take = raw[pos:pos + self._in_chunk]
                out.append(take)
                pos += len(take)
                self._in_chunk -= len(take)
                if self._in_chunk:
                    break
                self._crlf = True
            if self._crlf:
                if have - pos < 2:
                    break
                if raw[pos:pos + 2] != b"\r\n":
                    raise ValueError("a chunk did not end with CRLF")
                pos += 2
                self._crlf = False
            end = raw.find(b"\r\n", pos)
            if end < 0:
                if have - pos > _MAX_HEAD:
                    raise ValueError("a chunk size line longer than 64 KiB")
                break
            line, pos = raw[pos:end], end + 2
            if self._trailers:
                if not line:
                    self.complete = True
                    break
                continue
            size = int(line.split(b";", 1)[0], 16)
            if size == 0:
                self._trailers = True
            else:
                self._in_chunk = size
        self._raw = raw[pos:]
        return b"".join(out)

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        parts = []
        while (block := await self.next_block()) is not None:
            parts.append(block)
        return b"".join(parts)

    def release(self) -> None:
        """Back to the pool when the body was read to its end on a keep-alive connection, else closed."""
        self._conn.disarm()
        if self.complete and self._keep_alive:
            self._client.put(self._key, self._conn)
        else:
            self._conn.close()


class _Request:
    def __init__(self, client: "StreamingHTTP", url: str, path: str, body: bytes) -> None:
        self.client, self.url, self.path, self.body = client, url, path, body
        self.response: Optional[StreamResponse] = None

    async def __aenter__(self) -> StreamResponse:
        self.response = await self.client.send(self.url, self.path, self.body)
        return self.response

    async def __aexit__(self, *exc: object) -> None:
        if self.response is not None:
            self.response.release()


class StreamingHTTP:
    """Pooled keep-alive connections to engine servers; ``post(url, path, body)`` is an async context
    manager giving a :class:`StreamResponse`."""

    def __init__(self, read_timeout_s: float, connect_timeout_s: float = 30.0, idle_s: float = 15.0) -> None:
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._expiry: Optional[asyncio.TimerHandle] = None
        self._heads: dict[tuple[str, int, str], bytes] = {}
        self._keys: dict[str, tuple[str, int]] = {}  # url -> (host, port), parsed once per engine

    def post(self, url: str, path: str, body: bytes) -> _Request:
        return _Request(self, url, path, body)

    def failure(self, conn: _Connection, err: BaseException) -> StreamHTTPError:
        conn.close()
        if conn.timed_out:
            return StreamHTTPError(f"no data from the engine for {self.read_timeout_s:.0f} s", timed_out=True)
        return StreamHTTPError(f"the connection broke: {type(err).__name__}: {err}")

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(key[0], key[1], limit=_MAX_HEAD),
                                                    self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise StreamHTTPError(f"could not connect to {key[0]}:{key[1]} within {self.connect_timeout_s:.0f} s",
                                  connect_failed=True, timed_out=True) from None
        except OSError as err:
            raise StreamHTTPError(f"could not connect to {key[0]}:{key[1]}: {err}", connect_failed=True) from None
        return _Connection(reader, writer)

    def _take(self, key: tuple[str, int]) -> Optional[_Connection]:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.close()
        return None

    def put(self, key: tuple[str, int], conn: _Connection) -> None:
        if not conn.usable():
            conn.close()
            return
        loop = asyncio.get_running_loop()
        conn.idle_since = loop.time()
        self._idle.setdefault(key, []).append(conn)
        if self._expiry is None:
            self._expiry = loop.call_later(self.idle_s, self._expire, loop)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close connections idle for ``idle_s``; come back while any are left."""
        self._expiry = None
        cutoff = loop.time() - self.idle_s
        left = False
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if c.idle_since > cutoff and c.usable()]
            for conn in idle:
                if conn not in keep:
                    conn.close()
            self._idle[key] = keep
            left = left or bool(keep)
        if left:
            self._expiry = loop.call_later(self.idle_s, self._expire, loop)

    def _head(self, key: tuple[str, int], path: str) -> bytes:
        head = self._heads.get((*key, path))
        if head is None:
            host = f"[{key[0]}]" if ":" in key[0] else key[0]
            head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{key[1]}\r\nContent-Type: application/json\r\n"
                    "Accept: text/event-stream\r\nContent-Length: ").encode()
            self._heads[(*key, path)] = head
        return head

    async def send(self, url: str, path: str, body: bytes) -> StreamResponse:
        """Send the request, read the response head. A reused connection the server closed before reading
        the request is never used (checked before writing); a connection that breaks after the request
        was written is a lost connection (the engine may have started on it)."""
        key = self._keys.get(url)
        if key is None:
            key = self._keys[url] = _host_port(url)
        conn = self._take(key) or await self._connect(key)
        loop = asyncio.get_running_loop()
        conn.arm(loop, self.read_timeout_s)
        try:
            conn.writer.write(self._head(key, path) + str(len(body)).encode() + b"\r\n\r\n" + body)
            head = await conn.reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            version, code = lines[0].split(b" ", 2)[:2]
            headers: dict[bytes, bytes] = {}
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            status = int(code)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ValueError) as err:
            raise self.failure(conn, err) from None
        except BaseException:  # cancelled mid-request: the connection cannot be reused
            conn.close()
            raise
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        length = None if chunked or b"content-length" not in headers else int(headers[b"content-length"])
        keep_alive = version == b"HTTP/1.1" and headers.get(b"connection", b"").lower() != b"close"
        return StreamResponse(self, key, conn, status, chunked, length, keep_alive)

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
