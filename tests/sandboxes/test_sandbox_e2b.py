"""E2BSandbox through the real ``e2b`` SDK against FakeE2B (tests/sandboxes/e2b_fake.py), a local FAKE of
e2b's REST API and envd speaking their wire protocols; no e2b cloud here (no API key). Plus the clear
errors when the SDK or the key is missing."""

from __future__ import annotations

import importlib.util
import os
import shutil
import time

import pytest

from rayrl.config import SandboxConfig
from rayrl.sandboxes import SandboxError, SandboxHandle, SandboxUnavailable, create_sandbox, open_sandbox
from rayrl.sandboxes.pool import SandboxPool

HAVE_SDK = importlib.util.find_spec("e2b") is not None
needs_fake = pytest.mark.skipif(not HAVE_SDK or shutil.which("bwrap", path="/usr/bin:/bin") is None,
                                reason="needs the e2b SDK (pip install 'rayrl[e2b]') and bubblewrap")


def test_missing_sdk_or_key_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    expected = "E2B_API_KEY" if HAVE_SDK else "pip install"
    config = SandboxConfig(backend="e2b", image="base")
    with pytest.raises(SandboxUnavailable, match=expected):
        create_sandbox(config)
    with pytest.raises(SandboxUnavailable, match=expected):
        open_sandbox(SandboxHandle("e2b", "sbx-123", None, config))


def test_unknown_backend_is_refused():
    with pytest.raises(SandboxError, match="unknown"):
        open_sandbox(SandboxHandle("docker", "x", None, SandboxConfig()))


@pytest.fixture
def fake_e2b(monkeypatch):
    from e2b_fake import FakeE2B

    with FakeE2B() as fake:
        for key, value in fake.env.items():
            monkeypatch.setenv(key, value)
        yield fake


@needs_fake
def test_exec_files_and_close_against_the_fake(fake_e2b):
    config = SandboxConfig(backend="e2b", image="rayrl-test", files={"calc.py": "print(6*7)"})
    sb = create_sandbox(config)
    assert fake_e2b.create_requests[-1]["templateID"] == "rayrl-test"
    assert fake_e2b.create_requests[-1]["allow_internet_access"] is False  # network: false by default
    r = sb.exec("python3 calc.py; pwd; echo oops >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "42\n/home/user/workspace\n", "oops\n")
    assert not r.timed_out
    assert sb.exec(["printf", "%s|", "a b", "c"]).stdout == "a b|c|"
    sb.write_file("sub/data.bin", b"\x00\x01binary\xff")
    assert sb.read_file("sub/data.bin") == b"\x00\x01binary\xff"
    assert sb.exec("cat data.bin | wc -c", cwd="sub").stdout.strip() == "9"
    assert sb.exec("echo $FOO", env={"FOO": "bar"}).stdout == "bar\n"
    with pytest.raises(SandboxError):
        sb.read_file("missing.txt")
    with pytest.raises(SandboxError, match="outside"):
        sb.read_file("/etc/passwd")
    # Another process reopens it from the handle, as a rollout worker does with a lease.
    other = open_sandbox(sb.handle())
    assert other.read_file("calc.py") == b"print(6*7)"
    other.close()  # not the owner: the sandbox lives on
    assert sb.exec("true").ok
    sandbox_id = sb.sandbox_id
    sb.close()
    assert fake_e2b.killed == [sandbox_id] and sandbox_id not in fake_e2b.sandboxes
    with pytest.raises(SandboxError, match="closed"):
        sb.exec("true")


@needs_fake
def test_timeout_is_a_result_and_kills_the_command(fake_e2b):
    sb = create_sandbox(SandboxConfig(backend="e2b"))
    t0 = time.monotonic()
    r = sb.exec("echo started; sleep 30", timeout=1)
    assert r.timed_out and r.exit_code == 137 and time.monotonic() - t0 < 10
    box = fake_e2b.sandboxes[sb.sandbox_id]
    deadline = time.monotonic() + 5
    while box.procs and time.monotonic() < deadline:  # envd kills a command whose stream ended
        time.sleep(0.05)
    assert not box.procs
    assert sb.exec("echo alive").stdout == "alive\n"  # the sandbox itself is fine
    sb.close()


@needs_fake
def test_reset_gives_a_fresh_workdir_and_the_pool_recycles(fake_e2b):
    from rayrl.config import SandboxPoolConfig

    config = SandboxConfig(backend="e2b", files={"seed.txt": "seed"})
    pool = SandboxPool(config, SandboxPoolConfig(min_warm=1, max_size=1, recycle_after=2))
    try:
        first = pool.acquire("w")
        sb = open_sandbox(first.handle)
        sb.write_file("left-over.txt", b"x")
        pool.release(first.lease_id)
        second = pool.acquire("w")
        assert second.handle.sandbox_id == first.handle.sandbox_id
        sb = open_sandbox(second.handle)
        assert sb.exec("ls").stdout.split() == ["seed.txt"]
        pool.release(second.lease_id)  # second use: recycled, the e2b sandbox is killed
        assert first.handle.sandbox_id in fake_e2b.killed
    finally:
        pool.shutdown()
    assert fake_e2b.sandboxes == {}


@needs_fake
def test_bad_key_and_refused_allowed_hosts(fake_e2b, monkeypatch):
    with pytest.raises(SandboxUnavailable, match="allowed_hosts"):
        create_sandbox(SandboxConfig(backend="e2b", network=True, allowed_hosts=["example.com"]))
    create_sandbox(SandboxConfig(backend="e2b", network=True)).close()
    assert fake_e2b.create_requests[-1]["allow_internet_access"] is True
    monkeypatch.setenv("E2B_API_KEY", "e2b_wrong_key")
    with pytest.raises(SandboxError, match="could not create"):
        create_sandbox(SandboxConfig(backend="e2b"))
    assert os.environ["E2B_API_URL"] == fake_e2b.url  # never the real e2b API
