"""Admin route: the gateway's counters and its own durations per step, for a bench or a dashboard.

``GET /rayrl/stats`` with the gateway's admin token answers :func:`gateway_stats`: the counters
(requests, errors by kind, tokens generated, ...), sessions open, opened and finished, and the
summary of each duration histogram (``durations``: ``record_turn``, a turn recorded into its session's
tree; ``finish_session``, a session folded into samples; rayrl/gateway/durations.py). The trajectory
manager's ``stats`` (actors/gateway_shard.py) is the same dictionary plus its router's counters.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web


def gateway_stats(gateway: Any) -> dict[str, Any]:
    """The gateway's counters, sessions and duration summaries (reads only)."""
    sessions = gateway.sessions
    return {**gateway.counters, "open_sessions": sessions.open_sessions, "sessions_opened": sessions.opened,
            "sessions_closed": sessions.finished,
            "durations": {name: h.summary() for name, h in gateway.durations.items()}}


def stats_handler(gateway: Any) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The ``GET /rayrl/stats`` handler for ``gateway`` (401 without its admin token)."""

    async def handle(request: web.Request) -> web.Response:
        gateway._check_admin(request)
        return web.json_response(gateway_stats(gateway))

    return handle
