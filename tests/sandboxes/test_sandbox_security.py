"""Attacks that must fail under real isolation (bwrap and unshare). Each runs real commands."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from sbtest_helpers import ISOLATED, processes_matching


@pytest.fixture
def tcp_server():
    """A TCP server on host 127.0.0.1; records every connection it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted: list[tuple] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except OSError:
                continue
            accepted.append(addr)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join(2)
    server.close()


@pytest.mark.parametrize("mode", ISOLATED)
def test_no_network(make_sandbox, mode, tcp_server):
    port, accepted = tcp_server
    sb = make_sandbox(mode)
    code = f"import socket; s=socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')"
    r = sb.exec(["python3", "-c", code], timeout=10)
    assert r.exit_code != 0 and "CONNECTED" not in r.stdout
    assert "refused" in r.stderr.lower() or "unreachable" in r.stderr.lower(), r.stderr
    interfaces = [line.split(":")[0].strip() for line in sb.exec("cat /proc/net/dev").stdout.splitlines()[2:]]
    assert interfaces == ["lo"]
    time.sleep(0.3)
    assert accepted == []


@pytest.mark.parametrize("mode", ISOLATED)
def test_host_files_are_invisible(make_sandbox, mode):
    sb = make_sandbox(mode)
    for path in ("/root", "/etc/shadow", "/work/main", "/work", "/home", os.getcwd(), "/var",
                 "/proc/1/root/root"):
        r = sb.exec(["ls", "-la", path])
        assert r.exit_code != 0, f"{path} is visible: {r.stdout[:200]}"
    r = sb.exec("cat /etc/passwd")
    assert r.ok and "sandbox" in r.stdout and not any(u in r.stdout for u in ("daemon", "www-data", "_apt"))
    # Only our own processes are visible, and we hold no capabilities.
    pids = sb.exec("ls /proc | grep -c '^[0-9]'").stdout.strip()
    assert int(pids) < 10
    assert "CapEff:\t0000000000000000" in sb.exec("cat /proc/self/status").stdout


@pytest.mark.parametrize("mode", ISOLATED)
def test_other_sandboxes_are_invisible(make_sandbox, mode):
    victim, attacker = make_sandbox(mode), make_sandbox(mode)
    victim.write_file("secret.txt", b"victim secret")
    for target in (os.path.join(victim.paths.work, "secret.txt"), os.path.dirname(victim.paths.root)):
        r = attacker.exec(["cat", target])
        assert r.exit_code != 0 and "victim secret" not in r.stdout
    found = attacker.exec("find / -path /proc -prune -o -name secret.txt -print 2>/dev/null", timeout=20)
    assert not found.timed_out and found.stdout == ""


@pytest.mark.parametrize("mode", ISOLATED)
def test_cannot_write_outside_the_workdir(make_sandbox, mode):
    sb = make_sandbox(mode)
    marker = f"rayrl-escape-{os.getpid()}"
    for path in ("/usr/" + marker, "/etc/" + marker, "/" + marker, "/usr/bin/python3"):
        r = sb.exec(f"echo pwned > {path}")
        assert r.exit_code != 0, path
    assert sb.exec(f"echo private > /tmp/{marker} && cat /tmp/{marker}").stdout == "private\n"
    assert not os.path.exists(f"/tmp/{marker}")  # the sandbox's /tmp is its own
    assert not os.path.exists(f"/{marker}")


@pytest.mark.parametrize("mode", ISOLATED)
def test_fork_bomb_is_contained(make_sandbox, mode):
    sb = make_sandbox(mode, max_processes=32)
    counter = (
        "import os, time\n"
        "n = 0\n"
        "while n < 500:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5); os._exit(0)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print(n)\n"
    )
    r = sb.exec(["python3", "-c", counter], timeout=20)
    assert r.ok and int(r.stdout) < 32, r  # the process limit stopped it...
    assert r.duration_s < 5  # ...and the children died with the exec instead of being waited for
    t0 = time.monotonic()
    r = sb.exec("bomb() { bomb | bomb & }; bomb; sleep 2", timeout=3)
    assert time.monotonic() - t0 < 8
    assert sb.exec("echo alive").stdout == "alive\n"
    if sb.uid is not None:  # no live process of the sandbox uid is left on the host
        assert _live_processes_of(sb.uid) == []


def _live_processes_of(uid: int) -> list[str]:
    """Non-zombie host processes of ``uid`` (a reaped-later zombie runs no code, so it does not count)."""
    live = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            live.append(pid)
    return live


@pytest.mark.parametrize("mode", ISOLATED)
def test_memory_cpu_and_file_limits(make_sandbox, mode):
    sb = make_sandbox(mode, memory_mb=256, cpu_seconds=1, max_file_mb=1)
    r = sb.exec(["python3", "-c", "b = bytearray(1 << 30); print('allocated')"], timeout=20)
    assert r.exit_code != 0 and "allocated" not in r.stdout and "MemoryError" in r.stderr
    r = sb.exec(["python3", "-c", "while True: pass"], timeout=20)
    assert not r.timed_out and r.exit_code in (128 + 9, 128 + 24) and r.duration_s < 10
    r = sb.exec("head -c 3000000 /dev/zero > big.bin")
    assert r.exit_code != 0
    assert os.path.getsize(os.path.join(sb.paths.work, "big.bin")) <= 1 << 20


@pytest.mark.parametrize("mode", ISOLATED + ("none",))
def test_setsid_and_nohup_cannot_escape_the_timeout(make_sandbox, mode):
    sb = make_sandbox(mode)
    r = sb.exec("setsid sleep 987611 & nohup sleep 987612 >/dev/null 2>&1 & "
                "(setsid sh -c 'sleep 987613' >/dev/null 2>&1 &) ; sleep 100", timeout=1)
    assert r.timed_out
    time.sleep(0.2)
    assert [processes_matching(m) for m in ("987611", "987612", "987613")] == [[], [], []]


@pytest.mark.parametrize("mode", ISOLATED)
def test_sleeping_job_gone_after_close(make_sandbox, mode):
    sb = make_sandbox(mode)
    done = threading.Event()
    errors: list[Exception] = []

    def run() -> None:
        try:
            sb.exec("sleep 987621 & wait", timeout=60)
        except Exception as err:  # an exec racing close() may raise "closed"; either way it ends
            errors.append(err)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    sleeper = "sleep\x00987621"  # the sleep itself, not the launcher whose argv holds the command text
    for _ in range(250):
        if processes_matching(sleeper):
            break
        time.sleep(0.02)
    assert processes_matching(sleeper)
    sb.close()
    assert done.wait(5)
    assert processes_matching("987621") == []
