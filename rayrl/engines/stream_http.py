"""A lean HTTP/1.1 client for the router's streaming ``/generate`` calls, the gateway's hot path.

Why not aiohttp's client (which the rest of rayrl uses): every LLM call of every agent goes through this
path, and aiohttp builds each request through cookie jars, header merging, URL objects, tracing hooks and
timeouts meant for arbitrary servers. The engines are known servers on a private network (SGLang or the
CPU engine) and the request is always the same shape: a JSON ``POST`` answered by a server-sent event
stream. Written straight onto asyncio, a call costs far less CPU (docs/results/design_figures.md;
bench/gateway_profile.py), which the gateway's throughput is bound by.

Each connection is an ``asyncio.Protocol`` of its own (:class:`_Connection`), not a ``StreamReader``: the
bytes go into the response as they arrive, the chunked framing decoded there, and the waiting task is
woken only when what it asked for has come. A streaming caller asks for any bytes; one that does not
stream asks for the whole body, or a bound of bytes held (the router: ``StreamFold``'s), so an engine's
stream of one chunk per token, however many reads it arrives in, wakes it once (a StreamReader wakes its
reader on every read: a loop turn, a task step and a dozen calls each).

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

from rayrl.engines.stream_response import _MAX_HEAD, StreamResponse, _parse_head


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


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine, read by this protocol itself rather than an
    ``asyncio.StreamReader``: the bytes that arrive go straight into the response being read (its chunked
    framing decoded as they come), and the task waiting on the response is woken only when what it waits
    for is there. A caller that does not stream waits for the whole body (or ``hold`` bytes of it), so the
    engine's stream of one chunk per token, which arrives in as many reads as the two processes'
    scheduling makes, wakes it once instead of once per read."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: Optional[asyncio.Transport] = None
        self.head = b""  # the response head being read (bytes after it go to the response)
        self.response: Optional["StreamResponse"] = None  # the response whose body is being read
        self.waiting_head = False
        self.head_error: Optional[Exception] = None  # the response head could not be read
        self.request: Optional[tuple["StreamingHTTP", tuple[str, int], int]] = None  # (client, key, hold) of
        # the request whose head is awaited: the response is made here, as its head arrives
        self.closed = False  # the server closed it, it broke, or it was aborted
        self.stray = False  # bytes came while no request was waiting for them: never reused
        self.paused = False  # reading paused: the reader has not taken what it holds (flow control)
        self.waiter: Optional[asyncio.Future[None]] = None
        self.idle_since = 0.0
        self.deadline = 0.0  # loop time by which the pending read must make progress
        self.read_timeout_s = 0.0
        self.timed_out = False
        self.armed = False  # a request is being answered on it (idle in the pool: False)
        self._watchdog: Optional[asyncio.TimerHandle] = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.armed:
            self.deadline = self.loop.time() + self.read_timeout_s
        resp = self.response
        if resp is not None:
            resp.feed(data)
            if self.waiter is not None and resp.ready():
                self._wake()
            elif not self.paused and resp.over_high_water() and self.transport is not None:
                self.paused = True  # a reader slower than the engine: TCP holds the engine back meanwhile
                self.transport.pause_reading()
        elif self.waiting_head:
            self.head += data
            if b"\r\n\r\n" in self.head or len(self.head) > _MAX_HEAD:
                self._head_done()
        else:
            self.stray = True

    def _head_done(self) -> None:
        """The response head has arrived (or grown too long): the response is made now and fed what came
        after the head; the sender is woken once the response holds what it asked for
        (:meth:`StreamingHTTP.send`'s ``hold``), not at the head alone."""
        self.waiting_head = False
        head, self.head = self.head, b""
        request, self.request = self.request, None
        end = head.find(b"\r\n\r\n")
        if request is None:  # not awaited (the sender gave up): nobody reads it
            self.stray = True
            return
        client, key, hold = request
        try:
            if end < 0:
                raise ValueError("a response head longer than 64 KiB")
            resp = _parse_head(client, key, self, head[:end])
        except ValueError as err:
            self.head_error = err
            self._wake()
            return
        resp._hold = hold
        self.response = resp
        rest = head[end + 4:]
        if rest:
            resp.feed(rest)
        if resp.ready():
            self._wake()
        elif not self.paused and resp.over_high_water() and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def eof_received(self) -> Optional[bool]:
        self.closed = True
        self._wake()
        return None  # the transport closes itself

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        self._wake()

    # -- waiting

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until :meth:`data_received` finds what the reader waits for, or the connection ends."""
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def usable(self) -> bool:
        transport = self.transport
        return not (self.closed or self.stray or transport is None or transport.is_closing())

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    # -- the read timeout

    def arm(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        """Start watching reads. One timer per connection, kept across its requests: a timer that fires
        before the deadline (moved on by every read, and by the next request) is set again for it, and one
        that fires while the connection is idle in the pool lapses (the next request starts another). So a
        request on a reused connection schedules and cancels no timer of its own."""
        self.timed_out = False
        self.armed = True
        self.read_timeout_s = timeout_s
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
        self.abort()  # the pending read fails at once

    def disarm(self) -> None:
        """Stop watching reads (the timer, if any, lapses when it fires)."""
        self.armed = False

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def close(self) -> None:
        self.armed = False
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self.abort()


class _Request:
    def __init__(self, client: "StreamingHTTP", url: str, path: str, body: bytes, hold: int) -> None:
        self.client, self.url, self.path, self.body, self.hold = client, url, path, body, hold
        self.response: Optional[StreamResponse] = None

    async def __aenter__(self) -> StreamResponse:
        self.response = await self.client.send(self.url, self.path, self.body, self.hold)
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

    def post(self, url: str, path: str, body: bytes, hold: int = 1) -> _Request:
        """The request as an async context manager giving its response (``hold``: see :meth:`send`)."""
        return _Request(self, url, path, body, hold)

    def failure(self, conn: _Connection, err: BaseException) -> StreamHTTPError:
        conn.close()
        if conn.timed_out:
            return StreamHTTPError(f"no data from the engine for {self.read_timeout_s:.0f} s", timed_out=True)
        return StreamHTTPError(f"the connection broke: {type(err).__name__}: {err}")

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _Connection(loop), key[0], key[1]),
                                             self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise StreamHTTPError(f"could not connect to {key[0]}:{key[1]} within {self.connect_timeout_s:.0f} s",
                                  connect_failed=True, timed_out=True) from None
        except OSError as err:
            raise StreamHTTPError(f"could not connect to {key[0]}:{key[1]}: {err}", connect_failed=True) from None
        return conn

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

    async def send(self, url: str, path: str, body: bytes, hold: int = 1) -> StreamResponse:
        """Send the request; the response once its head has arrived and, with ``hold`` > 1, that many bytes
        of its body or its end (a reader that will ask :meth:`StreamResponse.next_block` for the whole body
        is woken once, not at the head and again at the body). A reused connection the server closed before
        reading the request is never used (checked before writing); a connection that breaks after the
        request was written is a lost connection (the engine may have started on it)."""
        key = self._keys.get(url)
        if key is None:
            key = self._keys[url] = _host_port(url)
        conn = self._take(key) or await self._connect(key)
        loop = asyncio.get_running_loop()
        conn.arm(loop, self.read_timeout_s)
        try:
            conn.head, conn.waiting_head, conn.head_error = b"", True, None
            conn.request = (self, key, max(1, hold))
            assert conn.transport is not None
            conn.transport.write(self._head(key, path) + str(len(body)).encode() + b"\r\n\r\n" + body)
            while (resp := conn.response) is None or not resp.ready():
                if conn.head_error is not None:
                    raise conn.head_error
                if conn.closed:
                    if resp is not None:
                        break  # the body's bytes so far, then the failure, come from next_block
                    raise ConnectionResetError("the connection closed before the response head")
                await conn.wait()
        except (ConnectionError, OSError, ValueError) as err:
            conn.waiting_head, conn.request = False, None
            raise self.failure(conn, err) from None
        except BaseException:  # cancelled mid-request: the connection cannot be reused
            conn.waiting_head, conn.request = False, None
            conn.close()
            raise
        resp._hold = 1  # next_block sets the hold it wants
        return resp

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
