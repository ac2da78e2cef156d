"""The gateway's LLM calls served without aiohttp's per-request machinery, on aiohttp's own parser.

Why: at one client a call's CPU in the gateway is spread thin (bench/gateway_profile.py), and a fixed part
of it is aiohttp's server around the handler: its per-connection task wakes on every request and starts a
second task for it (copying context variables: two more turns of the event loop per call on Python 3.11),
then routes it through the application's dispatcher and middleware chain. For the LLM routes none of that
does anything the gateway needs. :class:`LeanFront` is the connection's protocol instead: it reads the
requests with aiohttp's ``HttpRequestParser`` (the same C parser, limits and strictness aiohttp's server
uses: no parser of ours), and runs each LLM call in one task, as an aiohttp ``BaseRequest`` through the
gateway's own error handling (:meth:`Gateway.answer`) to an aiohttp response prepared and written by
aiohttp. So a call reads, fails and answers exactly as through aiohttp's server: same request object, same
JSON errors, same headers, streaming through aiohttp's writer with its flow control.

Only requests that need nothing else are served here: ``POST`` of an LLM route's exact path, HTTP/1.1,
a ``Content-Length`` body within the gateway's size limit, no ``Transfer-Encoding``, ``Expect``,
``Content-Encoding`` or ``Upgrade``. The first request that is anything else (another route, a chunked or
compressed body, a request the parser refuses) hands the connection to aiohttp's server for good: its
protocol takes the transport and is fed the bytes from that request's first byte on, as if it had read the
connection from there (:meth:`LeanFront._hand_over`). Requests are answered one at a time and in order
(pipelined ones wait, as in aiohttp). A client that disconnects cancels its call (aiohttp's
``handler_cancellation``), an idle keep-alive connection is closed after aiohttp's keep-alive timeout, and
the gateway's stop waits for calls in progress as aiohttp's shutdown does.

It builds on aiohttp's internal classes (parser, request handler, writer), which aiohttp may change in any
minor release: the gateway uses it only on the aiohttp versions it was checked on (:data:`CHECKED_AIOHTTP`,
:func:`fits_installed_aiohttp`); on any other, every connection goes to aiohttp's server, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Awaitable, Callable, Optional

import aiohttp
from aiohttp import hdrs, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.helpers import EMPTY_BODY_STATUS_CODES, rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpRequestParser, HttpVersion11, StreamWriter
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_writer import _serialize_headers
from aiohttp.tcp_helpers import tcp_keepalive
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

logger = logging.getLogger("rayrl.gateway")

CHECKED_AIOHTTP = ((3, 14),)  # the (major, minor) releases tests/gateway/test_lean_front.py has passed on


def fits_installed_aiohttp() -> bool:
    """Whether the installed aiohttp is one the lean front was checked on."""
    major, minor = (int(part) for part in aiohttp.__version__.split(".")[:2])
    return (major, minor) in CHECKED_AIOHTTP

# aiohttp's server's own settings for a connection (web_protocol.RequestHandler's defaults; the gateway's
# AppRunner changes none of them): the parser's limits and how long an idle keep-alive connection is kept
MAX_LINE_SIZE = 8190
MAX_HEADERS = 128
MAX_FIELD_SIZE = 8190
READ_BUFSIZE = 2**18
KEEPALIVE_S = 3630.0
LINGER_S = 10.0  # how long a body its handler did not read is read and dropped before the connection goes on
MAX_QUEUED = 32  # pipelined requests parsed ahead of the one being answered before reading pauses
WHOLE_BODY_BYTES = 65536  # a call whose body is no larger starts once the body is all in (_next)

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
_CRLF2 = b"\r\n\r\n"
_REFUSED_HEADERS = (hdrs.TRANSFER_ENCODING, hdrs.EXPECT, hdrs.CONTENT_ENCODING, hdrs.UPGRADE)


def plain_head(request: web.BaseRequest, response: web.StreamResponse) -> Optional[bytes]:
    """The status line and headers aiohttp writes for ``response`` (a :class:`web.Response` whose body is
    bytes, with no cookies, compression or chunking: every JSON answer of the gateway), made the way aiohttp's
    ``prepare`` makes them (the same headers in the same order: its ``Content-Length``, ``Date``, ``Server``
    and ``Connection`` rules, its own serializer), so the lean front writes head and body at once without
    aiohttp's per-response writer machinery. None for any other response: aiohttp's ``prepare`` writes it.
    The response's headers and keep-alive are updated as ``prepare`` would."""
    if (type(response) is not web.Response or response.prepared or response._cookies or response._compression
            or response.chunked or type(response._body) is not bytes or response.status in EMPTY_BODY_STATUS_CODES
            or request.version != HttpVersion11):
        return None
    headers = response._headers
    if hdrs.CONTENT_LENGTH not in headers:
        headers[hdrs.CONTENT_LENGTH] = str(len(response._body))
    if response._body:
        headers.setdefault(hdrs.CONTENT_TYPE, "application/octet-stream")
    if hdrs.DATE not in headers:
        headers[hdrs.DATE] = rfc822_formatted_time()
    headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE)
    keep_alive = response._keep_alive
    if keep_alive is None:
        keep_alive = response._keep_alive = request.keep_alive
    if not keep_alive and hdrs.CONNECTION not in headers:
        headers[hdrs.CONNECTION] = "close"
    return _serialize_headers(f"HTTP/1.1 {response.status} {response.reason}", headers)


class LeanFront(BaseProtocol):
    """One client connection: its LLM calls answered here, anything else handed to aiohttp's server.

    ``routes`` maps an LLM route's path to its handler; ``answer(request, handler)`` runs a handler with the
    gateway's error handling and returns the response; ``aiohttp_server()`` makes aiohttp's protocol for a
    connection handed over; ``max_body`` is the body size limit (the application's ``client_max_size``)."""

    def __init__(self, routes: dict[str, Handler], answer: Callable[[web.BaseRequest, Handler],
                 Awaitable[web.StreamResponse]], aiohttp_server: Callable[[], RequestHandler], max_body: int,
                 connections: set["LeanFront"]) -> None:
        loop = asyncio.get_running_loop()
        parser = HttpRequestParser(self, loop, READ_BUFSIZE, max_line_size=MAX_LINE_SIZE, max_headers=MAX_HEADERS,
                                   max_field_size=MAX_FIELD_SIZE, payload_exception=RequestPayloadError,
                                   auto_decompress=False)
        super().__init__(loop, parser)
        self._http = parser
        self._routes = routes
        self._answer = answer
        self._aiohttp_server = aiohttp_server
        self._max_body = max_body
        self._connections = connections
        self._raw = bytearray()  # the bytes from the first byte of the next request not taken on (a hand-over's)
        self._skip = 0  # bytes still to come of a taken request's body (not kept: its payload holds them)
        self._queue: deque[tuple[Any, Any]] = deque()  # parsed requests not answered yet, in order
        self._task: Optional[asyncio.Task[None]] = None
        self._waiting: Optional[tuple[Any, Any, int, int]] = None  # a call taken on, its body not all in yet
        self._refused = False  # the parser refused the bytes: aiohttp's server answers from the next request on
        self._closing = False
        self._idle_since = loop.time()
        self._idle_timer: Optional[asyncio.TimerHandle] = None
        # what aiohttp's request object reads from its server protocol (the gateway serves plain TCP)
        self.ssl_context = None
        self.peername: Any = None
        self.sockname: Any = None
        self.max_field_size, self.max_headers = MAX_FIELD_SIZE, MAX_HEADERS

    # -- asyncio.Protocol ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        tcp_keepalive(transport)  # as aiohttp's server sets it on its connections
        self.peername = transport.get_extra_info("peername")
        self.sockname = transport.get_extra_info("sockname")
        self._connections.add(self)
        self._idle_timer = self._loop.call_at(self._idle_since + KEEPALIVE_S, self._check_idle)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if self._skip:
            cut = min(self._skip, len(data))
            self._skip -= cut
            self._raw += data[cut:]
        elif data:
            self._raw += data
        if self._refused:
            return
        try:
            messages, _, _ = self._http.feed_data(data)
        except HttpProcessingError:
            self._refused = True  # aiohttp's server will read these bytes again and answer its 400
            messages = []
        self._queue.extend(messages)
        if len(self._queue) >= MAX_QUEUED:
            self._pause_reading_for_buffer()
        if self._task is None:
            self._next()

    def eof_received(self) -> None:
        return None  # the transport closes itself, as aiohttp's server lets it

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._closing = True
        self._connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)
        if self._waiting is not None:
            self._waiting[1].feed_eof()
            self._waiting = None
        for _, payload in self._queue:
            payload.feed_eof()
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()  # the client is gone: its call is cancelled (aiohttp's handler_cancellation)

    # -- requests ----------------------------------------------------------------------------------------

    def _next(self) -> None:
        """Answer the next request, or hand the connection over when it is not one of ours.

        A call whose body is small (``WHOLE_BODY_BYTES``) starts once the body is all in: a client that
        sends the head and the body in two writes (aiohttp's, httpx's) then costs the call one step of its
        task, not one that stops at reading the body and a second one woken by the body's arrival."""
        if self._closing or self.transport is None:
            return
        if self._waiting is not None:
            message, payload, start, end = self._waiting
            if len(self._raw) < end:
                return
            self._waiting = None
            self._start(message, payload, start, end)
            return
        if not self._queue:
            if self._refused:
                self._hand_over()
            return
        message, payload = self._queue.popleft()
        if self._buffer_paused and len(self._queue) < MAX_QUEUED // 2:
            self._resume_reading_for_buffer()
        extent = self._extent(message)
        if extent is None:
            self._hand_over()
            return
        start, end = extent
        if len(self._raw) < end <= len(self._raw) + WHOLE_BODY_BYTES:
            self._waiting = (message, payload, start, end)
            return
        self._start(message, payload, start, end)

    def _start(self, message: Any, payload: Any, start: int, end: int) -> None:
        """Serve the request whose body is ``_raw[start:end]``. A small body that is all in is handed to the
        request as read (aiohttp's ``BaseRequest.read`` returns it: the same bytes its payload holds), so
        the handler does not read it again through the payload's stream."""
        body = bytes(self._raw[start:end]) if end <= len(self._raw) and end - start <= WHOLE_BODY_BYTES else None
        # taken on: its bytes are not needed again (a hand-over starts after it), so a large body is not
        # held twice (here and in the request's payload)
        self._skip = max(0, end - len(self._raw))
        del self._raw[:end]
        self._task = self._loop.create_task(self._serve(message, payload, body))

    def _extent(self, message: Any) -> Optional[tuple[int, int]]:
        """Where in ``_raw`` the body of the request ``message`` (the first one there) starts and where the
        request ends, when it is one this front answers; None for anything aiohttp's server must answer."""
        handler_path = message.path if message.method == hdrs.METH_POST else None
        if handler_path not in self._routes or message.version != HttpVersion11 or message.upgrade:
            return None
        headers = message.headers
        if any(name in headers for name in _REFUSED_HEADERS) or message.chunked:
            return None
        length = headers.get(hdrs.CONTENT_LENGTH)
        if length is None or not length.isdigit() or int(length) > self._max_body:
            return None
        head = self._raw.find(_CRLF2)
        if head < 0 or not self._raw.startswith(b"POST "):  # blank lines before the request line: aiohttp's
            return None
        return head + 4, head + 4 + int(length)

    async def _serve(self, message: Any, payload: Any, body: Optional[bytes]) -> None:
        loop = self._loop
        keep_alive = False
        try:
            writer = StreamWriter(self, loop)
            request = web.BaseRequest(message, payload, self, writer, asyncio.current_task(loop),  # type: ignore
                                      loop, client_max_size=self._max_body)
            if body is not None:
                request._read_bytes = body
            response = await self._answer(request, self._routes[message.path])
            head = plain_head(request, response)
            if head is None:
                await response.prepare(request)
                await response.write_eof()
            else:
                transport = self.transport
                if transport is None or transport.is_closing():  # as aiohttp's writer refuses it
                    raise ClientConnectionResetError("Cannot write to closing transport")
                transport.writelines((head, response._body))
                if self._paused:  # a client that does not read: wait as aiohttp's writer would
                    await self._drain_helper()
            keep_alive = bool(response.keep_alive) and await self._drained(payload)
        except asyncio.CancelledError:  # the client went away, the gateway stops, or its session finished
            if not self._closing and self.transport is not None:
                self._closing = True  # as aiohttp's server: a cancelled call's connection is closed
                self.transport.close()
            raise
        except Exception:  # as aiohttp's server: logged, and the connection closed
            logger.exception("gateway: unhandled error answering %s %s", message.method, message.path)
        finally:
            self._task = None
        if self._closing or self.transport is None:
            return
        if not keep_alive:
            self._closing = True
            self.transport.close()
            return
        self._idle_since = loop.time()
        self._next()

    async def _drained(self, payload: Any) -> bool:
        """Whether the request's body has been read to its end, reading what its handler left (for at most
        aiohttp's lingering time, as aiohttp's server does): only then can the connection go on."""
        if payload.is_eof():
            return True
        try:
            async with asyncio.timeout(LINGER_S):
                while not payload.is_eof():
                    await payload.readany()
        except (asyncio.TimeoutError, RequestPayloadError, ConnectionError):
            return False
        return True

    # -- handing over, idling, stopping ---------------------------------------------------------------------

    def _hand_over(self) -> None:
        """aiohttp's server takes the connection, reading it from the current request's first byte on."""
        transport = self.transport
        if transport is None:
            return
        self._closing = True
        self._connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        for _, payload in self._queue:
            payload.feed_eof()
        self._queue.clear()
        data, self._raw = bytes(self._raw), bytearray()
        handler = self._aiohttp_server()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._buffer_paused or self._reading_paused:
            self._buffer_paused = self._reading_paused = False
            transport.resume_reading()
        if data:
            handler.data_received(data)

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self._closing or self.transport is None:
            return
        due = self._idle_since + KEEPALIVE_S
        if self._task is None and self._waiting is None and not self._queue and self._loop.time() >= due:
            self._closing = True
            self.transport.close()
            return
        self._idle_timer = self._loop.call_at(max(due, self._loop.time() + 1.0), self._check_idle)

    async def shutdown(self, timeout: float) -> None:
        """Let the call in progress finish (at most ``timeout`` s), then close, as aiohttp's shutdown does."""
        task = self._task
        if task is not None:
            await asyncio.wait([task], timeout=timeout)
            if not task.done():
                task.cancel()
        self._closing = True
        if self.transport is not None:
            self.transport.close()
