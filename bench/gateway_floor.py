"""The floor under the gateway's added latency at one client: what an extra hop costs on this machine
with less and less server in it, measured in alternation with the real gateway.

    python bench/gateway_floor.py [--requests 400] [--quick]

bench/gateway_overhead.py says the gateway adds about 1.1 ms to a call on the 2-core development machine
and its profiles say where the gateway's CPU goes; this says how much of the 1.1 ms any Python server in
the path would pay anyway, and so how much a leaner server than aiohttp's could save at most. The
sides, all reached by the overhead bench's client (aiohttp, one keep-alive connection, sequential calls),
all in front of the overhead bench's stub engine (each server in a process of its own):

- ``stub /generate``: the stub directly, a plain ``/generate`` (the overhead bench's baseline);
- ``stub /generate stream``: the stub directly, the streamed ``/generate`` the gateway sends (nine
  chunks read to the end): what streaming from the engine costs by itself;
- ``raw proxy``: an asyncio ``Protocol`` that forwards bytes both ways between the client and the stub,
  no HTTP parsing, the plain ``/generate`` passing through: the floor of one more hop in Python;
- ``lean server``: an asyncio ``Protocol`` that reads a ``Content-Length`` request with the least
  parsing possible (no validation at all) and forwards its body to the stub as the gateway does, over
  rayrl's engine client (rayrl/engines/stream_http.py), the streamed ``/generate`` read to the end and
  its last chunk answered: the floor of a hop that speaks HTTP and streams from the engine;
- ``C-parser server``: the same, the request read by aiohttp's own C parser (llhttp: line, header and
  field size limits, chunked bodies, pipelining) and answered straight onto the transport: the base a
  lean front for the LLM routes would stand on, without aiohttp's web layer;
- ``aiohttp server``: the same forwarding in one aiohttp handler (a ``web.Application`` with that route,
  the gateway's ``AppRunner`` settings): aiohttp's share, without the gateway's logic;
- ``aiohttp + router``: the same aiohttp server, the body decoded and sent through rayrl's Router
  (rayrl/engines/router.py: the engine picked, the stream read and accumulated, its chunks decoded), as
  the gateway sends it: the engine path's share;
- ``rayrl gateway``: the real gateway (Chat Completions: render, tokenize, stream from the engine,
  record the turn, answer), as the overhead bench runs it.

Each side's per-round figures: p50 and p99 of ``--requests`` sequential calls, and the server's CPU
per call (its main thread's, from /proc/<pid>/schedstat). Differences between sides are taken per
round (the same round's load on both) and reported as median [IQR] over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_overhead import (  # noqa: E402
    CHAT_CALL,
    MESSAGES,
    RAYRL,
    STUB,
    WARMUP,
    Target,
    _gateway_target,
    cpu_seconds,
    free_port,
    latency,
    pct,
    spawn,
    stop_all,
    wait_up,
)
from measure import Record, Spread, add_common_args, alternate  # noqa: E402

FLOORS = textwrap.dedent('''
    import asyncio, gc, sys
    import orjson
    from aiohttp import web
    from aiohttp.base_protocol import BaseProtocol
    from aiohttp.http_exceptions import HttpProcessingError
    from aiohttp.http_parser import HttpRequestParser
    from rayrl.engines.router import Router
    from rayrl.engines.stream_http import StreamingHTTP
    stub, raw_port, lean_port, parsed_port, aio_port = sys.argv[1], *map(int, sys.argv[2:6])
    router = None
    host, port = stub[7:].split(":")
    engine = StreamingHTTP(read_timeout_s=60.0)

    async def forward(body):
        """The gateway's engine call: the body as a streamed /generate, read to its end; its last chunk."""
        async with engine.post(stub, "/generate", body[:-1] + b', "stream": true}') as resp:
            data = await resp.read()
        return data[data.rfind(b"data: {") + 6:data.rfind(b"}") + 1]

    class Upstream(asyncio.Protocol):
        def __init__(self, down):
            self.down = down
        def data_received(self, data):
            self.down.write(data)
        def connection_lost(self, exc):
            self.down.close()

    class RawProxy(asyncio.Protocol):
        """Bytes both ways, no HTTP: the floor of one more hop."""
        def connection_made(self, transport):
            self.transport, self.up, self.pending = transport, None, []
            asyncio.get_running_loop().create_task(self.connect())
        async def connect(self):
            up, _ = await asyncio.get_running_loop().create_connection(lambda: Upstream(self.transport), host,
                                                                       int(port))
            self.up = up
            for data in self.pending:
                up.write(data)
        def data_received(self, data):
            if self.up is None:
                self.pending.append(data)
            else:
                self.up.write(data)
        def connection_lost(self, exc):
            if self.up is not None:
                self.up.close()

    class Lean(asyncio.Protocol):
        """HTTP/1.1 with Content-Length bodies and no checks at all: the least parsing a server can do."""
        def connection_made(self, transport):
            self.transport, self.buf = transport, b""
        def data_received(self, data):
            self.buf += data
            end = self.buf.find(b"\\r\\n\\r\\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            at = head.find(b"content-length:")
            stop = head.find(b"\\r\\n", at)
            length = int(head[at + 15:stop if stop > 0 else None]) if at >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4:end + 4 + length], self.buf[end + 4 + length:]
            asyncio.get_running_loop().create_task(self.answer(body))
        async def answer(self, body):
            out = await forward(body)
            self.transport.write(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nContent-Length: "
                                 + str(len(out)).encode() + b"\\r\\n\\r\\n" + out)

    class Parsed(BaseProtocol):
        """HTTP/1.1 read by aiohttp's own C parser (llhttp: the size limits, chunked bodies, pipelining),
        answered straight onto the transport: what a lean front for the LLM routes would be built on."""
        def __init__(self):
            loop = asyncio.get_running_loop()
            super().__init__(loop)
            self.parser = HttpRequestParser(self, loop, 2 ** 16, max_line_size=8190, max_field_size=8190,
                                            auto_decompress=False)
        def data_received(self, data):
            try:
                messages, _, _ = self.parser.feed_data(data)
            except HttpProcessingError:
                self.transport.write(b"HTTP/1.1 400 Bad Request\\r\\nContent-Length: 0\\r\\n"
                                     b"Connection: close\\r\\n\\r\\n")
                self.transport.close()
                return
            for message, payload in messages:
                asyncio.get_running_loop().create_task(self.answer(message, payload))
        async def answer(self, message, payload):
            out = await forward(await payload.read())
            self.transport.write(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nContent-Length: "
                                 + str(len(out)).encode() + b"\\r\\n\\r\\n" + out)

    async def aio(request):
        return web.Response(body=await forward(await request.read()), content_type="application/json")

    async def routed(request):
        """The gateway's engine path: the body decoded, Router.generate (streamed, accumulated)."""
        body = orjson.loads(await request.read())
        out = await router.generate(None, body["input_ids"], body["sampling_params"])
        return web.Response(body=orjson.dumps({"text": out.text, "output_ids": out.output_ids.tolist(),
                                               "logprobs": out.output_logprobs.tolist()}),
                            content_type="application/json")

    async def main():
        global router
        router = Router([stub])
        loop = asyncio.get_running_loop()
        await loop.create_server(RawProxy, "127.0.0.1", raw_port)
        await loop.create_server(Lean, "127.0.0.1", lean_port)
        await loop.create_server(Parsed, "127.0.0.1", parsed_port)
        app = web.Application()
        app.router.add_post("/generate", aio)
        app.router.add_post("/routed", routed)
        app.router.add_get("/health", lambda r: web.Response(text="ok"))
        runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", aio_port).start()
        gc.collect()  # the heap settled as the gateway's hosts settle theirs (rayrl.gateway.app.settle_heap)
        gc.freeze()
        gc.set_threshold(50_000, *gc.get_threshold()[1:])
        print("ready", flush=True)
        await asyncio.Event().wait()
    asyncio.run(main())
''')

SIDES = ("stub /generate", "stub /generate stream", "raw proxy", "lean server", "C-parser server", "aiohttp server",
         "aiohttp + router", "rayrl gateway")
# (what the hop adds over, what it adds): each row of the decomposition is one per-round difference
STEPS = [("stub /generate", "raw proxy", "one more hop, bytes forwarded (the floor)"),
         ("stub /generate", "stub /generate stream", "the engine streaming nine chunks instead of one answer"),
         ("raw proxy", "lean server", "HTTP parsed (least possible) + the engine client + the stream"),
         ("lean server", "C-parser server", "aiohttp's C parser (llhttp, limits enforced) instead of the least "
                                            "parsing"),
         ("C-parser server", "aiohttp server", "aiohttp's web server (request objects, task, routing, response) "
                                               "over its bare parser: what a lean front could save"),
         ("lean server", "aiohttp server", "aiohttp's server instead of the least parsing (what a leaner server "
                                           "could save at most)"),
         ("aiohttp server", "aiohttp + router", "rayrl's Router (pick, accumulate, decode the chunks) instead of the "
                                               "bare engine client"),
         ("aiohttp + router", "rayrl gateway", "the gateway's logic (middleware, session, render, tokenize, record, "
                                               "answer)"),
         ("stub /generate", "rayrl gateway", "the gateway's added latency (as bench/gateway_overhead.py)")]


async def make_targets(ports: dict[str, int], tokenizer_dir: str) -> dict[str, Target]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer_dir).apply_chat_template(MESSAGES, add_generation_prompt=True)
    gen = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}
    root = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    return {
        "stub /generate": Target("stub /generate", root["stub"] + "/generate", gen),
        "stub /generate stream": Target("stub /generate stream", root["stub"] + "/generate", {**gen, "stream": True}),
        "raw proxy": Target("raw proxy", root["raw"] + "/generate", gen),
        "lean server": Target("lean server", root["lean"] + "/generate", gen),
        "C-parser server": Target("C-parser server", root["parsed"] + "/generate", gen),
        "aiohttp server": Target("aiohttp server", root["aio"] + "/generate", gen),
        "aiohttp + router": Target("aiohttp + router", root["aio"] + "/routed", gen),
        "rayrl gateway": await _gateway_target("rayrl gateway", root["rayrl"], 1, CHAT_CALL),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="sequential requests per side per round")
    ap.add_argument("--rounds", type=int, default=12, help="most rounds (at least 6; fewer if the spread settles)")
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.requests = 30
    rounds = dict(min_rounds=2, max_rounds=2) if args.quick else dict(min_rounds=6, max_rounds=args.rounds,
                                                                      rel_iqr=0.05, budget_s=240)
    from rayrl.models import provision_smollm2

    record = Record("gateway_floor", "The floor under the gateway's added latency (one client)", quick=args.quick,
                    record_dir=args.record_dir)
    tokenizer_dir = str(provision_smollm2())
    ports = {k: free_port() for k in ("stub", "raw", "lean", "parsed", "aio", "rayrl")}
    procs: list[subprocess.Popen] = []
    loop = asyncio.new_event_loop()
    try:
        stub_url = f"http://127.0.0.1:{ports['stub']}"
        procs.append(spawn(STUB, str(ports["stub"])))
        loop.run_until_complete(wait_up(stub_url + "/health"))
        procs.append(spawn(FLOORS, stub_url, *(str(ports[k]) for k in ("raw", "lean", "parsed", "aio"))))
        procs.append(spawn(RAYRL, str(ports["rayrl"]), stub_url, tokenizer_dir))
        loop.run_until_complete(wait_up(f"http://127.0.0.1:{ports['aio']}/health"))
        loop.run_until_complete(wait_up(f"http://127.0.0.1:{ports['rayrl']}/health"))
        targets = loop.run_until_complete(make_targets(ports, tokenizer_dir))
        pid = {name: procs[1].pid for name in SIDES}  # the hops share one process
        pid.update({"stub /generate": procs[0].pid, "stub /generate stream": procs[0].pid,
                    "rayrl gateway": procs[2].pid})

        def side(target: Target):
            def go() -> dict[str, float]:
                cpu0 = cpu_seconds(pid[target.name])
                ms = [x * 1e3 for x in loop.run_until_complete(latency(target, args.requests))]
                cpu = (cpu_seconds(pid[target.name]) - cpu0) / (args.requests + WARMUP) * 1e3
                return {"p50": statistics.median(ms), "p99": pct(ms, 0.99), "cpu": cpu}
            return go

        res = alternate({name: side(targets[name]) for name in SIDES}, label="sides", **rounds)
    finally:
        loop.close()
        stop_all(procs)
    report(record, res, args.requests)
    record.save()


def report(record: Record, res: dict, requests: int) -> None:
    record.table(f"per side, median [IQR] (min-max, n) of per-round figures; a round = {requests} sequential "
                 "requests at one client", ["side", "p50 ms", "p99 ms", "server CPU ms/call"],
                 [[name, r["p50"].fmt(3), r["p99"].fmt(3), r["cpu"].fmt(3)] for name, r in res.items()])
    rows = []
    for base, over, what in STEPS:
        diff = {k: Spread(tuple(b - a for a, b in zip(res[base][k].samples, res[over][k].samples)))
                for k in ("p50", "cpu")}
        if base.startswith("stub") and not over.startswith("stub"):  # a hop over the stub: the hop's own CPU
            diff["cpu"] = res[over]["cpu"]
        rows.append([f"{over} - {base}", what, diff["p50"].fmt(3), diff["cpu"].fmt(3)])
        record.figure(f"{over} - {base}", diff)
    record.table("the decomposition: per-round differences of p50 and of CPU per call (the hop's whole CPU where "
                 "the step adds a hop to the stub alone)", ["step", "what", "p50 ms", "CPU ms/call"], rows)
    record.figure("sides", res)


if __name__ == "__main__":
    main()
