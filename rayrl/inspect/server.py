"""The inspector's web server: aiohttp's, serving the page and a small JSON API over one run directory.

Routes: ``GET /`` (the page), ``GET /api/run`` (config, metrics, every episode's summary row, problems),
``GET /api/episode?step=N&index=I`` (one episode's row, turn tree, token detail and the vocabulary its
tokens need). Every request re-reads what changed on disk (rayrl/inspect/reader.py), so a run that is
still training shows its new steps on the next poll. ``/api/run`` carries an ETag (the reader's stamp):
a poll that finds nothing changed is answered 304 from a few ``stat`` calls, without reading or
sending the run again.

Safety: it binds to loopback unless told otherwise. Bound anywhere else it requires a session token (one
is generated when none is given) in ``?token=`` or ``Authorization: Bearer``, compared in constant time;
the printed URL carries it. Bad input is a JSON 4xx naming the field (``{"error": {"message", "param"}}``),
an unknown episode a 404, never a traceback.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from rayrl.inspect.page import render_page
from rayrl.inspect.reader import RunReader


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "param": param}}, status=status)


def _int_param(request: web.Request, name: str) -> int:
    raw = request.query.get(name)
    if raw is None:
        raise _BadRequest(f"missing query parameter '{name}'", name)
    try:
        return int(raw)
    except ValueError:
        raise _BadRequest(f"'{name}' must be an integer, got {raw!r}", name) from None


class _BadRequest(Exception):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def make_app(reader: RunReader, token: str | None = None) -> web.Application:
    """The inspector app over ``reader``; with ``token`` every request must carry it."""

    @web.middleware
    async def guard(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if token is not None:
            auth = request.headers.get("Authorization", "")
            given = request.query.get("token") or (auth[7:].strip() if auth.lower().startswith("bearer ") else "")
            if not secrets.compare_digest(given.encode(), token.encode()):
                return _error(401, "this inspector needs its session token: open the URL it printed", "token")
        try:
            return await handler(request)
        except _BadRequest as err:
            return _error(400, err.message, err.param)
        except web.HTTPException as err:
            if err.status < 400:
                raise
            return _error(err.status, f"no route {request.method} {request.path}" if err.status == 404 else err.reason)

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=render_page(), content_type="text/html")

    async def run(request: web.Request) -> web.Response:
        etag = f'"{reader.stamp()}"'
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers={"ETag": etag, "Cache-Control": "no-cache"})
        summary = reader.read().summary()
        headers = {"ETag": f'"{summary["stamp"]}"', "Cache-Control": "no-cache"}
        return web.json_response(summary, headers=headers)

    async def episode(request: web.Request) -> web.Response:
        step, index = _int_param(request, "step"), _int_param(request, "index")
        detail = reader.episode(step, index)
        if detail is None:
            return _error(404, f"no episode {index} in step {step}", "index")
        return web.json_response(detail)

    app = web.Application(middlewares=[guard])
    app.router.add_get("/", page)
    app.router.add_get("/api/run", run)
    app.router.add_get("/api/episode", episode)
    return app


async def start(reader: RunReader, host: str, port: int, token: str | None) -> tuple[web.AppRunner, str]:
    """Serve on ``host:port`` (0: a free port); returns the runner and the URL to open."""
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(18)
    runner = web.AppRunner(make_app(reader, token), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound: Any = runner.addresses[0]  # (host, port[, ...]): the port the OS picked when port is 0
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    url = f"http://{shown}:{bound[1]}/" + (f"?token={token}" if token else "")
    return runner, url
