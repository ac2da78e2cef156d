"""One response of rayrl/engines/stream_http.py's client: its head parsed, its body's framing
(``Content-Length``, chunked, read-to-close) decoded as the bytes arrive, and the blocks handed to the
reader once what it asked for has come. The connection (stream_http's ``_Connection``) feeds it; the
client (``StreamingHTTP``) takes the connection back once the body is read to its end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from rayrl.engines.stream_http import StreamingHTTP, _Connection

_MAX_HEAD = 65536  # status line + headers
_WHOLE = 1 << 62  # next_block's hold for a reader that wants the whole body at once
_HIGH_WATER = 262144  # body bytes held for a reader (or twice its hold) before the engine's sends are paused


class StreamResponse:
    """One response: ``status``, then :meth:`next_block` until it returns None (or :meth:`read`). The body's
    bytes are decoded as they arrive (:meth:`feed`, called by the connection) and kept until the reader
    takes them."""

    def __init__(self, client: "StreamingHTTP", key: tuple[str, int], conn: _Connection, status: int,
                 chunked: bool, length: Optional[int], keep_alive: bool) -> None:
        self._client, self._key, self._conn = client, key, conn
        self.status = status
        self._chunked, self._left, self._keep_alive = chunked, length, keep_alive
        self.complete = False
        self._parts: list[bytes] = []  # body bytes decoded and not taken yet
        self._part_bytes = 0
        self._hold = 1  # the reader waits until this many body bytes are decoded (or the body ends)
        self._error: Optional[Exception] = None  # the framing broke: raised once the bytes before it are taken
        self._raw = b""  # chunked: bytes received and not decoded yet
        self._in_chunk = 0  # chunked: payload bytes of the current chunk still to come
        self._crlf = False  # chunked: the CRLF after a chunk's payload is due
        self._trailers = False  # chunked: the last chunk came; trailer lines until a blank one
        if length == 0 and not chunked:
            self.complete = True

    def feed(self, data: bytes) -> None:
        """Bytes of the body as they arrive (from the connection)."""
        if self.complete or self._error is not None:
            self._keep_alive = False  # bytes past the body's end: the connection's framing is lost
            return
        if self._chunked:
            self._raw += data
            block = self._dechunk()
            if self.complete and self._raw:
                self._keep_alive = False
        elif self._left is not None:
            block = data[:self._left]
            self._left -= len(block)
            if self._left <= 0:
                self.complete = True
                if len(block) < len(data):
                    self._keep_alive = False
        else:
            block = data
        if block:
            self._parts.append(block)
            self._part_bytes += len(block)

    def over_high_water(self) -> bool:
        """Whether the bytes held for the reader are enough to pause the connection until it takes them
        (never for a reader that waits for the whole body)."""
        return self._hold < _WHOLE and self._part_bytes >= max(_HIGH_WATER, 2 * self._hold)

    def ready(self) -> bool:
        """Whether the reader has something to do: bytes enough, the body's end, or a failure."""
        return (self._part_bytes >= self._hold or self.complete or self._error is not None
                or self._conn.closed)

    async def next_block(self, hold: int = 1) -> Optional[bytes]:
        """The body's bytes that arrived since the last call, once there are at least ``hold`` of them or
        the body ended (1: as soon as any arrive; a caller that needs only the whole body passes a bound on
        the bytes it wants held, and is woken once per that many); None at the body's end. A broken
        connection, a timeout or bad framing raises :class:`StreamHTTPError`, after the bytes that came
        before it were returned."""
        conn = self._conn
        self._hold = max(1, hold)
        if not self.ready():
            conn.deadline = conn.loop.time() + self._client.read_timeout_s
            try:
                await conn.wait()
            finally:
                self._hold = 1
        if self._parts:
            block = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
            self._parts.clear()
            self._part_bytes = 0
            if conn.paused and not conn.closed and conn.transport is not None:
                conn.paused = False
                conn.transport.resume_reading()
            return block
        if self._error is not None:
            raise self._client.failure(conn, self._error)
        if self.complete:
            return None
        if conn.closed and not conn.timed_out and not self._chunked and self._left is None:
            self.complete, self._keep_alive = True, False  # no length: the body ends when the server closes
            return None
        missing = "the connection closed before the body's end"
        raise self._client.failure(conn, ConnectionResetError(missing))

    def _dechunk(self) -> bytes:
        """Decode as much of the chunked framing in ``_raw`` as has arrived; the payload bytes so far. Bad
        framing is kept in ``_error`` (the payload before it is returned)."""
        raw, pos, out = self._raw, 0, []
        have = len(raw)
        try:
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
                if size < 0:
                    raise ValueError(f"a negative chunk size {size}")
                if size == 0:
                    self._trailers = True
                else:
                    self._in_chunk = size
        except ValueError as err:  # raised to the reader once it has taken the payload decoded before it
            self._error = err
            pos = have
        self._raw = raw[pos:]
        return b"".join(out)

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        parts = []
        while (block := await self.next_block(hold=_WHOLE)) is not None:
            parts.append(block)
        return b"".join(parts)

    def release(self) -> None:
        """Back to the pool when the body was read to its end on a keep-alive connection, else closed."""
        self._conn.disarm()
        self._conn.response = None
        if self.complete and self._keep_alive and not self._conn.paused:
            self._client.put(self._key, self._conn)
        else:
            self._conn.close()


def _parse_head(client: "StreamingHTTP", key: tuple[str, int], conn: _Connection, head: bytes) -> "StreamResponse":
    """The response a head (status line and headers, without the blank line) announces."""
    lines = head.split(b"\r\n")
    version, code = lines[0].split(b" ", 2)[:2]
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    status = int(code)
    chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
    length = None if chunked or b"content-length" not in headers else int(headers[b"content-length"])
    keep_alive = version == b"HTTP/1.1" and headers.get(b"connection", b"").lower() != b"close"
    return StreamResponse(client, key, conn, status, chunked, length, keep_alive)
