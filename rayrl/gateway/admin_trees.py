"""Admin route: one live session's turn tree, for inspection while the agent runs.

``GET /rayrl/sessions/{session_id}/tree[?text_chars=N]`` with the gateway's admin token answers the
session's tree as :mod:`rayrl.trajectory.describe` writes it (the same shape the run records keep and
``python -m rayrl.inspect`` draws), plus the session's request counters. Reading a tree never changes
it: the agent's calls, and the samples its session becomes, are the same whether or not anyone looks.
Errors are JSON 4xx like every gateway route: 401 without the admin token, 404 for a session that is
not open on this shard, 400 naming ``text_chars`` when it is not an integer in range.

:func:`describe_session` is the one place a session is described; the gateway uses it too,
to hand a finished session's tree back with its episode.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from rayrl.gateway.errors import RequestError
from rayrl.gateway.sessions import SessionRegistry
from rayrl.trajectory.describe import DEFAULT_TEXT_CHARS

MAX_TEXT_CHARS = 1_000_000  # one message's text; a request for more is refused, not truncated silently


def describe_session(
    sessions: SessionRegistry, session_id: str, text_chars: int = DEFAULT_TEXT_CHARS
) -> dict[str, Any]:
    """An open session's tree description with its request counters (404 RequestError if not open)."""
    session = sessions.get(session_id)
    tree = session.tree.describe(text_chars)
    tree["session"] = {"session_id": session_id, "metadata": session.metadata, "api_calls": session.api_calls,
                       "requests": session.requests, "failed_requests": session.failed_requests,
                       "cumulative_hits": session.cumulative_hits}
    return tree


def _text_chars(request: web.Request) -> int:
    raw = request.query.get("text_chars")
    if raw is None:
        return DEFAULT_TEXT_CHARS
    try:
        value = int(raw)
    except ValueError:
        raise RequestError(f"text_chars must be an integer, got {raw!r}", param="text_chars") from None
    if not 0 <= value <= MAX_TEXT_CHARS:
        raise RequestError(f"text_chars must be between 0 and {MAX_TEXT_CHARS}, got {value}", param="text_chars")
    return value


def tree_handler(gateway: Any) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The route's handler bound to ``gateway`` (which checks the admin token and owns the sessions)."""

    async def handle(request: web.Request) -> web.Response:
        gateway._check_admin(request)
        text_chars = _text_chars(request)
        return web.json_response(describe_session(gateway.sessions, request.match_info["session_id"], text_chars))

    return handle
