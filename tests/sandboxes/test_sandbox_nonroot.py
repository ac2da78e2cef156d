"""The local sandbox works for an ordinary user too (when the suite runs as root, it checks that by
running a probe as a freshly created unprivileged user; as non-root, the whole suite already does)."""

from __future__ import annotations

import os
import pwd
import shutil
import site
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USER = "rayrl-sbtest"

PROBE = r"""
import os, tempfile
from rayrl.config import SandboxConfig
from rayrl.sandboxes.local import LocalSandbox
root = tempfile.mkdtemp(prefix="rrl-nonroot-")
sb = LocalSandbox(SandboxConfig(isolation="auto"), root=root)
r = sb.exec(["python3", "-c", "import os; print(os.getuid(), os.getpid())"], timeout=20)
print("RUN", r.exit_code, r.stdout.strip())
r = sb.exec("ls /root /work /home 2>&1; echo x > /usr/evil 2>&1", timeout=20)
print("LOOK", r.stdout.replace(chr(10), " | "))
sb.close()
os.rmdir(root)
"""

# Two HTTP servers on the loopback of the probe (run as the ordinary user); the sandbox may reach A only.
NETWORK_PROBE = r"""
import http.server, os, tempfile, threading
from rayrl.config import SandboxConfig
from rayrl.sandboxes.local import LocalSandbox
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello " + self.path.encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), H) for _ in range(2)]
for s in servers: threading.Thread(target=s.serve_forever, daemon=True).start()
a, b = (s.server_address[1] for s in servers)
config = SandboxConfig(isolation="auto", network=True, allowed_hosts=["127.0.0.1:%d" % a])
root = tempfile.mkdtemp(prefix="rrl-nonroot-")
sb = LocalSandbox(config, root=root)
print("UID", os.getuid(), sb.isolation)
print("ALLOWED", sb.exec("curl -sS -m 10 http://127.0.0.1:%d/a" % a, timeout=30).stdout)
denied = "curl -sS -m 10 -w %%{http_code} -o /dev/null http://127.0.0.1:%d/" % b
print("DENIED", sb.exec(denied, timeout=30).stdout)
print("BYPASS", sb.exec("curl -sS -m 5 --noproxy '*' http://127.0.0.1:%d/" % a, timeout=30).exit_code)
print("STATS", sb.network_stats())
sb.close()
os.rmdir(root)
"""


def _run_as_ordinary_user(probe: str) -> str:
    """Run ``probe`` (python source) as an unprivileged user; skips where that cannot be arranged."""
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if system_python is None or shutil.which("useradd") is None:
        pytest.skip("needs /usr/bin/python3 and useradd to run a probe as another user")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", USER], check=True)
    # the probe imports rayrl from the repo and its dependencies from this environment's site-packages
    paths = [str(ROOT), *site.getsitepackages()]
    for p in [ROOT, *ROOT.parents]:
        if p.stat().st_mode & 0o005 != 0o005:
            pytest.skip(f"{p} is not readable by other users")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(paths), "HOME": "/tmp"}
    out = subprocess.run(["su", USER, "-s", "/bin/sh", "-c", f"{system_python} -c '{probe}'"],
                         capture_output=True, text=True, timeout=120, env=env, cwd="/tmp")
    if "No module named" in out.stderr:
        pytest.skip("the system python3 cannot load this environment's packages: " + out.stderr[-200:])
    return out.stdout + "\nSTDERR\n" + out.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="already running as an ordinary user")
def test_sandbox_as_ordinary_user():
    out = _run_as_ordinary_user(PROBE)
    assert "RUN 0" in out, out
    uid, pid = out.split("RUN 0", 1)[1].split()[:2]
    assert int(uid) != 0  # unprivileged inside (bwrap presents its own uid mapping)
    assert int(pid) < 10  # its own PID namespace
    look = out.split("LOOK", 1)[1].split("STDERR")[0]
    assert "No such file or directory" in look or "Permission denied" in look or "Read-only" in look
    assert "main" not in look.split("evil")[0]  # the project directory is not visible


@pytest.mark.skipif(os.geteuid() != 0, reason="already running as an ordinary user")
def test_allowed_hosts_proxy_as_ordinary_user():
    out = _run_as_ordinary_user(NETWORK_PROBE)
    assert "UID " in out and "UID 0 " not in out, out
    assert "ALLOWED hello /a" in out, out
    assert "DENIED 403" in out, out
    bypass = out.split("BYPASS", 1)[1].split()[0]
    assert bypass != "0", out
    assert "'allowed': 1, 'denied': 1" in out, out
