"""free_port: picks outside the kernel's ephemeral range, claimed per process, never a port in use.

The cross-process case runs real processes picking at once; without the claims, 800 picks from the
~17,000 candidate ports would coincide somewhere almost surely (the birthday bound), and so they did before.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from rayrl import ports


@pytest.fixture
def own_claims(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "claims_dir", lambda: tmp_path / "claims")
    return tmp_path / "claims"


def test_a_pick_is_bindable_outside_the_ephemeral_range_and_claimed_for_this_process(own_claims):
    low, high = ports.ephemeral_range()
    picks = [ports.free_port() for _ in range(50)]
    assert len(set(picks)) == 50
    for port in picks:
        assert ports.FIRST_PORT <= port <= ports.LAST_PORT and not low <= port <= high
        assert ports.bindable("127.0.0.1", port)
        assert (own_claims / str(port)).read_text() == str(os.getpid())


def test_processes_picking_at_once_never_get_the_same_port(tmp_path):
    script = textwrap.dedent("""
        import sys
        from rayrl.ports import free_port
        print(" ".join(str(free_port()) for _ in range(200)), flush=True)
        sys.stdin.read()  # stay alive (holding the claims) until the test has every pick
    """)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(4)]
    try:
        picks = [int(p) for proc in procs for p in proc.stdout.readline().split()]
    finally:
        for proc in procs:
            proc.communicate("", timeout=60)
    assert len(picks) == 800 and len(set(picks)) == 800


def test_a_live_processs_claim_is_respected_and_a_dead_ones_is_taken_over(own_claims):
    port = ports.FIRST_PORT + 17
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        own_claims.mkdir()
        (own_claims / str(port)).write_text(str(holder.pid))
        assert ports.claim(port) is False
    finally:
        holder.kill()
        holder.wait()
    assert ports.claim(port) is True
    assert (own_claims / str(port)).read_text() == str(os.getpid())
    (own_claims / str(port + 1)).write_text("")  # a writer that died mid-write
    assert ports.claim(port + 1) is True


def test_a_port_something_listens_on_is_skipped_and_its_claim_given_back(own_claims, monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        if not any(taken in span for span in ports.candidate_spans()):  # the OS picked inside the ephemeral range
            monkeypatch.setattr(ports, "candidate_spans", lambda: [range(taken, taken + 1),
                                                                   range(ports.FIRST_PORT, ports.FIRST_PORT + 500)])
        spans = ports.candidate_spans()
        index_of_taken = next(i for i, p in enumerate(p for span in spans for p in span) if p == taken)
        draws = iter([index_of_taken])
        real = ports._RNG.randrange
        monkeypatch.setattr(ports._RNG, "randrange", lambda n: next(draws, real(n)))  # the taken port first
        port = ports.free_port()
    assert port != taken and not (own_claims / str(taken)).exists()
    assert (own_claims / str(port)).exists()


def test_without_ports_outside_the_ephemeral_range_the_os_picks(own_claims, monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    assert ports.candidate_spans() == []
    port = ports.free_port()
    assert 1024 <= port <= 65535 and ports.bindable("127.0.0.1", port)


def test_without_a_writable_claims_directory_the_bind_test_alone_guards(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setattr(ports, "claims_dir", lambda: blocker / "claims")
    assert ports.claim(ports.FIRST_PORT) is None
    port = ports.free_port()
    assert ports.bindable("127.0.0.1", port)


def test_picks_neither_follow_nor_move_the_seeded_random_stream(own_claims):
    import random

    random.seed(1234)
    expected = [random.random() for _ in range(3)]
    random.seed(1234)
    first = ports.free_port()
    assert [random.random() for _ in range(3)] == expected
    random.seed(1234)
    assert ports.free_port() != first  # claimed by this process: never handed out twice
