"""The router's lean HTTP/1.1 client (rayrl/engines/stream_http.py) against real servers on loopback.

An aiohttp server (what the CPU engine is) answers with chunked server-sent events, Content-Length
bodies and errors; raw asyncio servers play what aiohttp will not: a body that ends when the server
closes, a server that closes an idle keep-alive connection, one that stalls, one that dies mid-body.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from rayrl.engines.stream_http import StreamHTTPError, StreamingHTTP

EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]


async def _aiohttp_server() -> tuple[web.AppRunner, str, list]:
    peers: list = []

    async def sse(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        assert await request.json() == {"q": 1}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in EVENTS:
            await resp.write(event)
        await resp.write_eof()
        return resp

    async def fixed(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        return web.json_response({"ok": True, "pad": "x" * 100000})

    async def error(request: web.Request) -> web.Response:
        return web.json_response({"message": "bad request"}, status=400)

    app = web.Application()
    app.router.add_post("/sse", sse)
    app.router.add_post("/fixed", fixed)
    app.router.add_post("/error", error)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", peers


async def _read_request(reader: asyncio.StreamReader) -> None:
    """Read one request's head and its ``Content-Length`` body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    await reader.readexactly(length)


async def _raw_server(answer) -> tuple[asyncio.AbstractServer, str, list]:
    """A server that reads one request head + body per connection and lets ``answer(writer)`` reply."""
    connections: list = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        try:
            await _read_request(reader)
            await answer(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", connections


def test_chunked_events_and_reused_connections():
    async def run():
        runner, url, peers = await _aiohttp_server()
        http = StreamingHTTP(read_timeout_s=10)
        try:
            for _ in range(3):
                async with http.post(url, "/sse", b'{"q": 1}') as resp:
                    assert resp.status == 200
                    assert await resp.read() == b"".join(EVENTS)
            async with http.post(url, "/fixed", b'{"q": 1}') as resp:  # a Content-Length body
                assert resp.status == 200 and len(await resp.read()) > 100000
            assert len(set(peers)) == 1  # one keep-alive connection served all four
            async with http.post(url, "/error", b"{}") as resp:
                assert resp.status == 400 and b"bad request" in await resp.read()
        finally:
            await http.close()
            await runner.cleanup()

    asyncio.run(run())


def test_a_body_that_ends_when_the_server_closes():
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\ndata: a\n\ndata: b\n\n")
        await writer.drain()
        writer.close()

    async def run():
        server, url, _ = await _raw_server(answer)
        http = StreamingHTTP(read_timeout_s=10)
        try:
            async with http.post(url, "/x", b"{}") as resp:
                assert await resp.read() == b"data: a\n\ndata: b\n\n"
            assert not http._idle.get(("127.0.0.1", int(url.rsplit(":", 1)[1])))  # not kept: it was closed
        finally:
            await http.close()
            server.close()

    asyncio.run(run())


def test_chunked_framing_split_anywhere():
    """Chunk sizes with extensions, trailers, and every byte in a TCP segment of its own."""
    body = [b"data: first\n\n", b"data: " + b"x" * 300 + b"\n\n", b"data: [DONE]\n\n"]
    wire = b"".join(b"%x;ext=1\r\n" % len(c) + c + b"\r\n" for c in body) + b"0\r\nX-Trailer: t\r\n\r\n"

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(len(wire)):
            writer.write(wire[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0)

    async def run():
        server, url, connections = await _raw_server(answer)
        http = StreamingHTTP(read_timeout_s=10)
        try:
            async with http.post(url, "/x", b"{}") as resp:
                assert await resp.read() == b"".join(body) and resp.complete
        finally:
            await http.close()
            server.close()

    asyncio.run(run())


def test_a_connection_the_server_closed_while_idle_is_not_reused():
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # keep-alive by its headers, closed soon after (uvicorn's idle timeout does this)

    async def run():
        server, url, connections = await _raw_server(answer)
        http = StreamingHTTP(read_timeout_s=10)
        try:
            for _ in range(2):
                async with http.post(url, "/x", b"{}") as resp:
                    assert await resp.read() == b"ok"
                await asyncio.sleep(0.3)
            assert len(connections) == 2  # the closed connection was dropped, a new one made
        finally:
            await http.close()
            server.close()

    asyncio.run(run())


def test_a_stalled_stream_times_out_and_a_broken_one_is_lost():
    async def stall(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    async def die(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n20\r\ndata: cut")
        await writer.drain()
        writer.transport.abort()

    async def run():
        for answer, timed_out in ((stall, True), (die, False)):
            server, url, _ = await _raw_server(answer)
            http = StreamingHTTP(read_timeout_s=0.5)
            try:
                received = []
                async with http.post(url, "/x", b"{}") as resp:
                    with pytest.raises(StreamHTTPError) as info:
                        while True:
                            received.append(await resp.next_block())
                assert info.value.timed_out == timed_out and not info.value.connect_failed
                assert b"".join(received).startswith(b"data: a\n\n")  # what came before the failure
            finally:
                await http.close()
                server.close()

    asyncio.run(run())


def test_a_refused_connection_says_nothing_ran():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there

    async def run():
        http = StreamingHTTP(read_timeout_s=5)
        with pytest.raises(StreamHTTPError) as info:
            async with http.post(f"http://127.0.0.1:{port}", "/x", b"{}"):
                pass
        assert info.value.connect_failed
        await http.close()

    asyncio.run(run())


def test_idle_connections_are_closed():
    async def run():
        runner, url, _ = await _aiohttp_server()
        http = StreamingHTTP(read_timeout_s=10, idle_s=0.2)
        try:
            async with http.post(url, "/sse", b'{"q": 1}') as resp:
                await resp.read()
            (conn,) = http._idle[("127.0.0.1", int(url.rsplit(":", 1)[1]))]
            await asyncio.sleep(0.6)
            assert conn.is_closing() and not any(http._idle.values())
        finally:
            await http.close()
            await runner.cleanup()

    asyncio.run(run())


def test_the_read_timeout_spans_requests_on_a_reused_connection():
    """The watchdog timer is kept per connection: idle in the pool past the read timeout, a connection is
    not aborted (its next request is answered on it); a stall on that reused connection still times out."""
    answers = ["ok", "ok", "stall"]

    async def answer(writer: asyncio.StreamWriter) -> None:
        kind = answers.pop(0)
        if kind == "ok":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    async def handle_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while answers:
                await _read_request(reader)
                await answer(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def run():
        server = await asyncio.start_server(handle_all, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        http = StreamingHTTP(read_timeout_s=0.3, idle_s=10)
        try:
            async with http.post(url, "/x", b"{}") as resp:
                assert await resp.read() == b"ok"
            (conn,) = next(iter(http._idle.values()))
            await asyncio.sleep(0.5)  # idle past the read timeout: the timer lapses, the connection stays
            assert conn.usable() and not conn.timed_out
            async with http.post(url, "/x", b"{}") as resp:
                assert await resp.read() == b"ok"
            assert resp._conn is conn  # the same connection answered again
            loop = asyncio.get_running_loop()
            started = loop.time()
            async with http.post(url, "/x", b"{}") as resp:
                assert resp._conn is conn
                with pytest.raises(StreamHTTPError) as info:
                    while await resp.next_block() is not None:
                        pass
            assert info.value.timed_out and 0.25 <= loop.time() - started < 5
        finally:
            await http.close()
            server.close()

    asyncio.run(run())


def test_a_reader_that_waits_for_the_whole_body_is_woken_once():
    """The engine's stream arriving in many reads: a streaming reader gets it read by read, one that asks
    for the whole body (or a bound of bytes held) is woken once (once per bound), with the same bytes."""
    events = [b'data: {"n": %d, "pad": "%s"}\n\n' % (i, b"y" * 20) for i in range(30)] + [b"data: [DONE]\n\n"]
    wire = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for i in range(0, len(wire), 45):  # cut across chunk boundaries, each piece in a read of its own
            writer.write(wire[i:i + 45])
            await writer.drain()
            await asyncio.sleep(0.002)

    async def blocks(http: StreamingHTTP, url: str, hold: int) -> list[bytes]:
        got = []
        async with http.post(url, "/x", b"{}") as resp:
            while (block := await resp.next_block(hold)) is not None:
                got.append(block)
        return got

    async def run():
        server, url, _ = await _raw_server(answer)
        http = StreamingHTTP(read_timeout_s=10)
        try:
            streamed = await blocks(http, url, 1)
            whole = await blocks(http, url, 1 << 30)
            bounded = await blocks(http, url, 400)
        finally:
            await http.close()
            server.close()
        assert b"".join(streamed) == b"".join(whole) == b"".join(bounded) == b"".join(events)
        assert len(streamed) > 10 and len(whole) == 1
        assert 1 < len(bounded) < len(streamed) and all(len(b) >= 400 for b in bounded[:-1])

    asyncio.run(run())


def test_a_sender_that_asks_for_the_whole_body_is_woken_once_for_head_and_body(monkeypatch):
    """``post(..., hold)``: the response is given once its head and the bytes held for (or its end) have
    come, so the router's call that does not stream waits once, not for the head and again for the body."""
    from rayrl.engines import stream_http

    events = [b'data: {"n": %d}\n\n' % i for i in range(8)] + [b"data: [DONE]\n\n"]
    wire = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        await writer.drain()
        for i in range(0, len(wire), 30):  # the head in a read of its own, then the body in pieces
            await asyncio.sleep(0.002)
            writer.write(wire[i:i + 30])
            await writer.drain()

    waits = []
    real_wait = stream_http._Connection.wait

    async def counted(self):
        waits.append(1)
        await real_wait(self)

    monkeypatch.setattr(stream_http._Connection, "wait", counted)

    async def whole(http: StreamingHTTP, url: str, hold: int) -> list[bytes]:
        got = []
        async with http.post(url, "/x", b"{}", hold) as resp:
            assert resp.status == 200
            while (block := await resp.next_block(1 << 30)) is not None:
                got.append(block)
        return got

    async def run():
        server, url, _ = await _raw_server(answer)
        http = StreamingHTTP(read_timeout_s=10)
        try:
            at_head = await whole(http, url, 1)
            waits_at_head = len(waits)
            waits.clear()
            at_body = await whole(http, url, 1 << 30)
        finally:
            await http.close()
            server.close()
        assert b"".join(at_head) == b"".join(at_body) == b"".join(events)
        assert waits_at_head == 2 and len(waits) == 1

    asyncio.run(run())


def test_a_reader_slower_than_the_engine_holds_the_engine_back():
    """Flow control: a streaming reader that does not take what arrives pauses the connection once a bound
    of bytes is held (the engine's sends then wait on TCP), and gets every byte when it reads again."""
    piece = b"data: " + b"z" * 16378 + b"\n\n"  # 16 KiB events, 8 MiB in all
    count = 512
    sent: list[int] = []

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for _ in range(count):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            sent.append(len(piece))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def run():
        server, url, _ = await _raw_server(answer)
        http = StreamingHTTP(read_timeout_s=10)
        try:
            async with http.post(url, "/x", b"{}") as resp:
                first = await resp.next_block()
                await asyncio.sleep(0.5)  # the reader is away: the engine keeps sending
                conn = resp._conn
                held = resp._part_bytes
                assert conn.paused and held < 2 * 1024 * 1024 and sum(sent) < count * len(piece)
                rest = [first]
                while (block := await resp.next_block()) is not None:
                    rest.append(block)
            assert b"".join(rest) == piece * count
        finally:
            await http.close()
            server.close()

    asyncio.run(run())


def test_bad_framing_fails_after_the_bytes_before_it():
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\nzz\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async def run():
        server, url, _ = await _raw_server(answer)
        http = StreamingHTTP(read_timeout_s=10)
        try:
            async with http.post(url, "/x", b"{}") as resp:
                assert await resp.next_block(1 << 30) == b"data: a\n\n"
                with pytest.raises(StreamHTTPError) as info:
                    await resp.next_block()
            assert not info.value.timed_out and "ValueError" in str(info.value)
        finally:
            await http.close()
            server.close()

    asyncio.run(run())


def test_dechunk_decodes_everything_that_has_arrived():
    """One _dechunk call decodes every complete chunk in the buffer (the whole body at once: all of it, and
    the end seen); cut anywhere, the pieces' payloads join to the same bytes."""
    import random

    from rayrl.engines.stream_response import StreamResponse

    payloads = [b"data: %d %s\n\n" % (i, b"x" * (i * 37 % 300)) for i in range(12)] + [b"data: [DONE]\n\n"]
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in payloads) + b"0\r\nTrailer: t\r\n\r\n"

    def decoder() -> StreamResponse:
        return StreamResponse(None, ("h", 1), None, 200, chunked=True, length=None, keep_alive=True)  # type: ignore[arg-type]

    whole = decoder()
    whole._raw = body
    assert whole._dechunk() == b"".join(payloads) and whole.complete and whole._raw == b""
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randint(1, 40)))
        resp, out = decoder(), []
        for a, b in zip([0, *cuts], [*cuts, len(body)]):
            resp._raw += body[a:b]
            out.append(resp._dechunk())
        assert b"".join(out) == b"".join(payloads) and resp.complete
