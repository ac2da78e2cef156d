"""Sessions: one per episode, each with its own bearer token and trajectory tree.

A session also knows whether it met an infrastructure failure: ``infra_errors`` counts its LLM calls
that failed because of the engine or the gateway (a 5xx answer, in-stream or not: an unreachable
engine, a generation the engine failed or aborted, a gateway bug), and ``infra_error`` keeps the first
one's message. Such a call recorded no turn, so an episode whose agent carried on after it still looks
complete in its tree; these two fields are how the episode runner tells (``Gateway.session_stats``).
``failed_requests`` counts the calls that reached an engine and failed there (a subset, with engine
rejections of a request answered 400 included). ``admitted`` counts the LLM calls admitted against
``gateway.max_turns_per_session`` and ``turn_cap_refusals`` those refused by it (turns.py).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from rayrl.config import TrajectoryConfig
from rayrl.gateway.durations import DurationHistogram
from rayrl.gateway.errors import RequestError
from rayrl.trajectory import TrajectoryTree
from rayrl.trajectory.events import TreeCallback, load_callback
from rayrl.trajectory.messages import messages_equal
from rayrl.types import Sample, TurnRecord

_RECENT_TURNS = 8  # turns kept as candidates for cumulative token mode


@dataclass
class SessionInfo:
    """What an agent needs to talk to the gateway: its session id, bearer token and base URL."""

    session_id: str
    token: str
    base_url: str


@dataclass
class Session:
    session_id: str
    token: str
    metadata: dict[str, Any]
    tree: TrajectoryTree
    created: float = field(default_factory=time.monotonic)
    finished: bool = False
    recent: list[TurnRecord] = field(default_factory=list)
    api_calls: int = 0  # authenticated API requests (what a client POSTed), whatever their outcome
    requests: int = 0  # requests that reached an engine
    failed_requests: int = 0  # ... and failed there (an engine error, an aborted generation, a rejection)
    infra_errors: int = 0  # LLM calls answered with a 5xx (module docstring)
    infra_error: str | None = None  # the first one's message
    cumulative_hits: int = 0
    admitted: int = 0  # LLM calls admitted (rendered, counted against gateway.max_turns_per_session)
    turn_cap_refusals: int = 0  # ... and refused because the session had used its turns
    # what the guards read (rayrl/rl/guards.py), counted per recorded turn:
    tool_turns: int = 0  # turns whose request declared tools
    tool_parse_errors: int = 0  # turns where the model wrote a tool call the parser could not read
    length_turns: int = 0  # turns the engine cut at max_tokens (finish reason "length")
    last_finish: str = ""  # the last recorded turn's finish: "stop", "tool_calls" or "length"
    in_flight: set = field(default_factory=set)
    record: bool = True  # False: calls are answered and counted, their turns kept nowhere (a frozen model's
    # endpoint, rayrl/gateway/frozen.py: nothing of it is ever trained on, and a run-long session must not grow)

    def note_infra_error(self, message: str) -> None:
        """Count a call that failed because of the engine or the gateway (once per answer)."""
        self.infra_errors += 1
        if self.infra_error is None:
            self.infra_error = message

    def remember(self, turn: TurnRecord, prev: TurnRecord | None = None) -> None:
        """Keep ``turn`` as a candidate for cumulative token mode (the newest ``_RECENT_TURNS``).

        ``prev``: the remembered turn whose messages + response start ``turn.messages`` (what
        :meth:`history_match` found for its request). Each request brings its whole history as fresh
        dicts, so kept as sent, a session's remembered turns held 1 + 2 + ... + n message dicts (with their
        tool calls' nested dicts) for n turns: objects the cyclic collector walks on every full collection.
        Kept instead is ``prev``'s messages and response (the same dicts) followed by the request's new
        messages (the dicts the tree mounted), so remembered turns add one list each and share the rest.
        The tools list is shared with ``prev``'s when equal, for the same reason.
        """
        if prev is not None:
            k = len(prev.messages) + 1
            tools = prev.tools if turn.tools is not None and turn.tools == prev.tools else turn.tools
            turn = replace(turn, messages=[*prev.messages, prev.response_message, *turn.messages[k:]], tools=tools)
        self.recent.append(turn)
        if len(self.recent) > _RECENT_TURNS:
            del self.recent[0]

    def history_match(self, messages: list[dict[str, Any]]) -> TurnRecord | None:
        """The most recent recorded turn whose messages + response start ``messages``.

        Messages compare structurally (trajectory.messages.messages_equal: key order, empty fields
        and reasoning fields never matter), the same rule routing uses, so whatever routes onto a turn
        also reuses its exact tokens. The newest message is compared first: it differs most often.
        """
        n = len(messages)
        for turn in reversed(self.recent):
            k = len(turn.messages)
            if n <= k + 1 or not messages_equal(messages[k], turn.response_message):
                continue
            if all(messages_equal(a, b) for a, b in zip(messages[:k], turn.messages)):
                return turn
        return None


class SessionRegistry:
    """Sessions by id and by token. A finished session's token still gets 409 (finished), not 401, yet
    nothing is kept per finished session: a token is a random part and its MAC under this registry's
    key, so a token the registry issued and no longer holds is one whose session finished. (A set of
    finished tokens grew by about 120 bytes per session for the life of the run: a gigabyte over ten
    million episodes.)

    ``debug_callback`` (default: ``trajectory.debug_callback``) is handed to every new session's tree.
    """

    def __init__(self, trajectory_cfg: TrajectoryConfig, shard: int = 0,
                 debug_callback: TreeCallback | None = None) -> None:
        self.cfg = trajectory_cfg
        self.shard = shard
        self.debug_callback = debug_callback or load_callback(trajectory_cfg.debug_callback)
        self._by_id: dict[str, Session] = {}
        self._by_token: dict[str, Session] = {}
        self._key = secrets.token_bytes(32)  # signs this registry's tokens (never leaves the process)
        self.opened = 0
        self.finished = 0
        self.finish_times = DurationHistogram()  # each session's fold into samples (durations.py)

    def open(self, metadata: dict[str, Any] | None = None, session_id: str | None = None) -> Session:
        sid = session_id or f"s{self.shard}-{uuid.uuid4().hex}"
        if sid in self._by_id:
            raise RequestError(f"session {sid} already exists", status=409)
        nonce = secrets.token_urlsafe(24)
        token = f"rrl-{nonce}.{self._mac(nonce)}"
        tree = TrajectoryTree(
            fork_merge_max_response_tokens=self.cfg.fork_merge_max_response_tokens, on_drift=self.cfg.on_drift,
            session_id=sid, debug_callback=self.debug_callback,
        )
        session = Session(session_id=sid, token=token, metadata=dict(metadata or {}), tree=tree)
        self._by_id[sid] = session
        self._by_token[token] = session
        self.opened += 1
        return session

    def by_token(self, token: str | None) -> Session:
        if not token:
            raise RequestError("missing API key: send 'Authorization: Bearer <session token>'", status=401)
        session = self._by_token.get(token)
        if session is None:
            if self._issued(token):
                raise RequestError("this session has finished; open a new one", status=409)
            raise RequestError("invalid API key", status=401)
        return session

    def _mac(self, nonce: str) -> str:
        return hmac.new(self._key, nonce.encode(), hashlib.sha256).hexdigest()[:32]

    def _issued(self, token: str) -> bool:
        """Whether this registry made ``token`` (compared in constant time)."""
        nonce, dot, mac = token.removeprefix("rrl-").rpartition(".")
        return bool(dot) and token.startswith("rrl-") and hmac.compare_digest(mac.encode(), self._mac(nonce).encode())

    def get(self, session_id: str) -> Session:
        session = self._by_id.get(session_id)
        if session is None:
            raise RequestError(f"no open session {session_id!r}", status=404)
        return session

    def finish(self, session_id: str, reward: float, metadata: dict[str, Any] | None = None) -> list[Sample]:
        """Close a session and fold its turns into samples; the session's memory is freed."""
        started = time.perf_counter()
        samples = self._finish(session_id, reward, metadata)
        self.finish_times.add(time.perf_counter() - started)
        return samples

    def _finish(self, session_id: str, reward: float, metadata: dict[str, Any] | None) -> list[Sample]:
        session = self.get(session_id)
        session.finished = True
        self._by_id.pop(session_id, None)
        self._by_token.pop(session.token, None)
        self.finished += 1
        meta = {**session.metadata, **(metadata or {})}
        samples = session.tree.samples(
            reward,
            meta,
            session_id=session_id,
            group_id=str(meta.get("group_id", "")),
        )
        session.tree.close()
        session.recent.clear()
        return samples

    def stats_of(self, session_id: str) -> dict[str, Any]:
        """The session's tree stats plus its request counters and infrastructure failures."""
        session = self.get(session_id)
        return {**session.tree.stats(), "api_calls": session.api_calls, "requests": session.requests,
                "failed_requests": session.failed_requests, "cumulative_hits": session.cumulative_hits,
                "infra_errors": session.infra_errors, "infra_error": session.infra_error,
                "turn_cap_refusals": session.turn_cap_refusals, "tool_turns": session.tool_turns,
                "tool_parse_errors": session.tool_parse_errors, "length_turns": session.length_turns,
                "last_finish": session.last_finish}

    @property
    def open_sessions(self) -> int:
        return len(self._by_id)


def versions_from(weight_version: str, per_token: np.ndarray | None) -> int | np.ndarray:
    """Policy version(s) of a response from the engine's weight_version string (ints by convention)."""
    if per_token is not None:
        return per_token
    try:
        return int(weight_version)
    except (TypeError, ValueError):
        return 0
