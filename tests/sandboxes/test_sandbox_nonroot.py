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
import tempfile
from rayrl.config import SandboxConfig
from rayrl.sandboxes.local import LocalSandbox
sb = LocalSandbox(SandboxConfig(isolation="auto"), root=tempfile.mkdtemp(prefix="rrl-nonroot-"))
r = sb.exec(["python3", "-c", "import os; print(os.getuid(), os.getpid())"], timeout=20)
print("RUN", r.exit_code, r.stdout.strip())
r = sb.exec("ls /root /work /home 2>&1; echo x > /usr/evil 2>&1", timeout=20)
print("LOOK", r.stdout.replace(chr(10), " | "))
sb.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="already running as an ordinary user")
def test_sandbox_as_ordinary_user(tmp_path):
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
    out = subprocess.run(["su", USER, "-s", "/bin/sh", "-c", f"{system_python} -c '{PROBE}'"],
                         capture_output=True, text=True, timeout=120, env=env, cwd="/tmp")
    if "No module named" in out.stderr:
        pytest.skip("the system python3 cannot load this environment's packages: " + out.stderr[-200:])
    assert "RUN 0" in out.stdout, out.stdout + out.stderr
    uid, pid = out.stdout.split("RUN 0", 1)[1].split()[:2]
    assert int(uid) != 0  # unprivileged inside (bwrap presents its own uid mapping)
    assert int(pid) < 10  # its own PID namespace
    look = out.stdout.split("LOOK", 1)[1]
    assert "No such file or directory" in look or "Permission denied" in look or "Read-only" in look
    assert "main" not in look.split("evil")[0]  # the project directory is not visible
