"""The Sandbox protocol on the local backend, for every isolation level (real processes throughout)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
from sbtest_helpers import UNSHARE, processes_matching

from rayrl.config import SandboxConfig
from rayrl.sandboxes import SandboxError, SandboxUnavailable, create_sandbox, local, open_sandbox
from rayrl.sandboxes import isolation as iso

MODES = ("bwrap", UNSHARE, "none")


@pytest.mark.parametrize("mode", MODES)
def test_exec_string_and_list(make_sandbox, mode):
    sb = make_sandbox(mode)
    r = sb.exec("echo hi; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "hi\n", "err\n", False)
    assert r.duration_s > 0
    r = sb.exec(["python3", "-c", "import sys; print(sys.argv[1])", "a b; $(rm -rf /) 'c'"])
    assert r.ok and r.stdout == "a b; $(rm -rf /) 'c'\n"
    r = sb.exec(["no-such-binary-xyz"])
    assert r.exit_code == 127 and not r.timed_out
    assert sb.exec("kill -9 $$").exit_code == 137


@pytest.mark.parametrize("mode", MODES)
def test_env_is_scrubbed(make_sandbox, mode, monkeypatch):
    monkeypatch.setenv("RAYRL_HOST_SECRET", "do-not-leak")
    sb = make_sandbox(mode)
    r = sb.exec(["env"], env={"FOO": "bar baz"})
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert env["FOO"] == "bar baz" and env["LANG"] == "C.UTF-8" and "RAYRL_HOST_SECRET" not in env
    allowed = {"PATH", "HOME", "LANG", "FOO", "PWD", "TMPDIR", iso.MARKER_ENV}
    assert set(env) <= allowed, set(env) - allowed
    assert env["HOME"] == ("/workspace" if mode != "none" else sb.paths.work)
    with pytest.raises(SandboxError):
        sb.exec("true", env={"BAD=KEY": "x"})


@pytest.mark.parametrize("mode", MODES)
def test_cwd(make_sandbox, mode):
    sb = make_sandbox(mode)
    sb.write_file("sub/dir/f.txt", b"x")
    r = sb.exec("pwd; ls", cwd="sub/dir")
    assert r.stdout.splitlines()[0].endswith("/sub/dir") and "f.txt" in r.stdout
    assert sb.exec("pwd", cwd="/workspace/sub").stdout.strip().endswith("/sub")
    for bad in ("..", "../x", "/etc", "missing"):
        with pytest.raises(SandboxError):
            sb.exec("pwd", cwd=bad)


@pytest.mark.parametrize("mode", MODES)
def test_timeout_kills_the_tree(make_sandbox, mode):
    sb = make_sandbox(mode)
    t0 = time.monotonic()
    r = sb.exec("sleep 987601 & sleep 987602", timeout=0.5)
    assert r.timed_out and r.exit_code == 137
    assert time.monotonic() - t0 < 3
    assert processes_matching("987601") == [] and processes_matching("987602") == []
    assert sb.exec("echo still-works").stdout == "still-works\n"


@pytest.mark.parametrize("mode", MODES)
def test_background_job_does_not_outlive_exec(make_sandbox, mode):
    sb = make_sandbox(mode)
    r = sb.exec("sleep 987603 & echo started", timeout=5)
    assert r.stdout == "started\n" and r.duration_s < 3
    assert processes_matching("987603") == []


@pytest.mark.parametrize("mode", MODES)
def test_write_and_read_files(make_sandbox, mode):
    sb = make_sandbox(mode, files={"preloaded/hello.txt": "hi there"})
    assert sb.read_file("preloaded/hello.txt") == b"hi there"
    blob = bytes(range(256)) * 10
    sb.write_file("d/e/blob.bin", blob)
    assert sb.read_file("/workspace/d/e/blob.bin") == blob
    assert sb.exec("od -An -tu1 d/e/blob.bin | wc -w").stdout.strip() == "2560"
    sb.exec("echo made-inside > inside.txt && chmod 000 d")
    assert sb.read_file("inside.txt") == b"made-inside\n"
    sb.write_file("inside.txt", b"overwritten")
    assert sb.exec("cat inside.txt").stdout == "overwritten"
    with pytest.raises(FileNotFoundError):
        sb.read_file("nope.txt")


@pytest.mark.parametrize("mode", MODES)
def test_path_escapes_are_refused(make_sandbox, mode, sandbox_root):
    sb = make_sandbox(mode)
    for bad in ("../x", "a/../../x", "/etc/passwd", "/workspace/../etc/passwd", "", "."):
        with pytest.raises(SandboxError):
            sb.write_file(bad, b"x")
        with pytest.raises(SandboxError):
            sb.read_file(bad)
    # Symlinks planted by sandboxed code are never followed by the host side.
    outside = os.path.join(sandbox_root, "outside-target")
    with open(outside, "w") as f:
        f.write("host file")
    link_target = outside if mode == "none" else "/etc/passwd"
    r = sb.exec(f"ln -s {link_target} link && ln -s / rootdir && mkfifo fifo")
    assert r.ok, r
    with pytest.raises(SandboxError):
        sb.read_file("link")
    with pytest.raises(SandboxError):
        sb.write_file("link", b"pwned")
    with pytest.raises(SandboxError):
        sb.write_file("rootdir/tmp/pwned", b"pwned")
    with pytest.raises(SandboxError):
        sb.read_file("fifo")  # would block forever if opened naively
    assert open(outside).read() == "host file"
    assert not os.path.exists("/tmp/pwned")


@pytest.mark.parametrize("mode", ("bwrap", "none"))
def test_output_is_truncated(make_sandbox, mode):
    sb = make_sandbox(mode, max_output_bytes=1000)
    r = sb.exec("head -c 300000 /dev/zero | tr '\\0' a; head -c 5000 /dev/zero | tr '\\0' b >&2")
    assert r.ok
    assert r.stdout.startswith("a" * 1000) and "output truncated, 299000 more bytes" in r.stdout
    assert r.stderr.startswith("b" * 1000) and "4000 more bytes" in r.stderr
    big = make_sandbox(mode).exec("head -c 3000000 /dev/zero | tr '\\0' c")
    assert big.ok and len(big.stdout) < 1_000_100 and "2000000 more bytes" in big.stdout


def test_bad_arguments(make_sandbox):
    sb = make_sandbox("bwrap")
    for bad in ([], [1, 2], None, ["a\0b"]):
        with pytest.raises(SandboxError):
            sb.exec(bad)
    with pytest.raises(SandboxError):
        sb.exec("true", timeout=0)
    with pytest.raises(SandboxError):
        sb.write_file("x", "not bytes")


def test_close_kills_running_commands_and_removes_the_directory(make_sandbox):
    sb = make_sandbox("bwrap")
    errors = []

    def run() -> None:
        try:
            sb.exec("sleep 987604", timeout=30)
        except SandboxError as err:
            errors.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    for _ in range(250):
        if processes_matching("sleep\x00987604"):  # the sleep itself, not the launcher's argv
            break
        time.sleep(0.02)
    sb.close()
    worker.join(5)
    assert not worker.is_alive() and "closed while the command ran" in str(errors[0])
    assert processes_matching("987604") == []
    assert not os.path.exists(sb.paths.root)
    with pytest.raises(SandboxError):
        sb.exec("true")
    sb.close()  # twice is fine


def test_handle_reopens_in_another_process(make_sandbox, tmp_path):
    sb = make_sandbox("bwrap")
    sb.set_lease("lease-1")
    handle_file = tmp_path / "handle.pkl"
    handle_file.write_bytes(pickle.dumps(sb.handle()))
    code = (
        "import pickle, sys\n"
        "from rayrl.sandboxes import open_sandbox\n"
        "sb = open_sandbox(pickle.load(open(sys.argv[1], 'rb')))\n"
        "sb.write_file('from_other.txt', b'other process')\n"
        "r = sb.exec(['sh', '-c', 'cat from_other.txt; echo; echo $$'])\n"
        "sb.close()\n"
        "print(r.stdout, end='')\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(handle_file)], capture_output=True, text=True,
                         timeout=60, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "other process"
    assert sb.read_file("from_other.txt") == b"other process"  # the other process' close kept the files
    # A reopened handle stops working as soon as its lease ends (fencing a late episode).
    other = open_sandbox(sb.handle())
    assert other.exec("true").ok
    sb.set_lease("lease-2")
    with pytest.raises(SandboxError, match="lease"):
        other.exec("true")
    with pytest.raises(SandboxError, match="lease"):
        other.write_file("x", b"x")


def test_reset_restores_a_fresh_workdir(make_sandbox):
    sb = make_sandbox("bwrap", files={"calc.py": "print(1)"})
    sb.exec("echo junk > junk.txt; mkdir -p d && chmod 000 d")
    sb.reset()
    assert sb.exec("ls").stdout.split() == ["calc.py"]


def test_auto_picks_isolation_and_never_runs_unisolated(sandbox_root, monkeypatch, tmp_path):
    with create_sandbox(SandboxConfig(isolation="auto"), root=sandbox_root) as sb:
        assert sb.isolation in ("bwrap", "unshare")
        assert sb.exec("python3 -c 'print(6*7)'").stdout == "42\n"
    # No isolation tool on the (fixed) tool path: auto must refuse, naming what is missing.
    monkeypatch.setattr(iso, "HOST_TOOL_PATH", str(tmp_path))
    monkeypatch.setattr(iso, "_probe_results", {})
    with pytest.raises(SandboxUnavailable, match="bwrap.*not installed.*unshare"):
        local.LocalSandbox(SandboxConfig(isolation="auto"), root=sandbox_root)
    assert [p for p in os.listdir(sandbox_root) if p.startswith("sb-")] == []  # nothing left behind


def test_allowed_hosts_without_isolation_are_refused_rather_than_ignored(sandbox_root):
    config = SandboxConfig(isolation="none", network=True, allowed_hosts=["example.com"])
    with pytest.raises(SandboxUnavailable, match="allowed_hosts.*isolation=none"):
        local.LocalSandbox(config, root=sandbox_root)


def test_isolation_none_warns_loudly_once(make_sandbox, monkeypatch, caplog):
    monkeypatch.setattr(local, "_warned_none", False)
    with caplog.at_level("WARNING"):
        make_sandbox("none")
        make_sandbox("none")
    assert sum("UNISOLATED" in r.getMessage() for r in caplog.records) == 1


def test_orphaned_sandboxes_of_a_dead_process_are_removed(make_sandbox, sandbox_root):
    alive = make_sandbox("bwrap")
    code = (
        "import os, sys\n"
        "from rayrl.config import SandboxConfig\n"
        "from rayrl.sandboxes.local import LocalSandbox\n"
        "sb = LocalSandbox(SandboxConfig(isolation='bwrap'), root=sys.argv[1])\n"
        "print(sb.paths.root, flush=True)\n"
        "os._exit(0)  # a crash: nothing is closed\n"
    )
    out = subprocess.run([sys.executable, "-c", code, sandbox_root], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    orphan = out.stdout.strip()
    assert os.path.isdir(orphan)
    assert local.remove_orphans(sandbox_root) == 1
    assert not os.path.exists(orphan) and os.path.isdir(alive.paths.root)
