"""Session tokens: a finished session's token answers 409 (finished) and any other token 401, while the
registry keeps nothing per finished session (a run opens millions). Plain SessionRegistry, no server."""

from __future__ import annotations

import tracemalloc

import pytest

from rayrl.config import TrajectoryConfig
from rayrl.gateway.errors import RequestError
from rayrl.gateway.sessions import SessionRegistry


def _status(registry: SessionRegistry, token: str) -> int:
    try:
        registry.by_token(token)
    except RequestError as err:
        return err.status
    return 200


def test_finished_is_409_and_foreign_or_forged_is_401():
    registry, other = SessionRegistry(TrajectoryConfig()), SessionRegistry(TrajectoryConfig())
    session = registry.open()
    assert _status(registry, session.token) == 200
    registry.finish(session.session_id, 0.0)
    assert _status(registry, session.token) == 409
    assert _status(other, session.token) == 401  # another gateway's (or a previous run's) token
    nonce, mac = session.token.rsplit(".", 1)
    forged = [nonce + "." + ("0" if mac[0] != "0" else "1") + mac[1:], nonce, "rrl-" + mac, "x" + session.token,
              session.token + ".", "rrl-.", "rrl-é.é"]
    assert [_status(registry, t) for t in forged] == [401] * len(forged)
    with pytest.raises(RequestError) as missing:
        registry.by_token("")
    assert missing.value.status == 401


def test_finished_sessions_leave_nothing_behind():
    registry = SessionRegistry(TrajectoryConfig())
    for _ in range(50):  # warm: first-call allocations are not per session
        registry.finish(registry.open().session_id, 0.0)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    tokens = []
    for i in range(2000):
        session = registry.open()
        if i % 97 == 0:  # a few kept to ask with (the test's own references)
            tokens.append(session.token)
        registry.finish(session.session_id, 0.0)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename")
                if stat.traceback[0].filename.endswith("sessions.py"))
    assert grown < 20_000, grown  # a set of finished tokens held ~230 KB here
    assert all(_status(registry, t) == 409 for t in tokens)
