"""The local Ray that driver.py starts: token authentication on, dashboard on loopback only, and a new
cluster even where Ray's temp dir names one that is gone (a ``ray start`` killed earlier on the machine)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import json, os, socket, urllib.error, urllib.request
    import psutil, ray
    from actors.runtime import init_ray
    from rayrl.config import RayConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    ctx = init_ray(RayConfig(num_cpus=1, include_dashboard=True, dashboard_port=port))
    url = f"http://127.0.0.1:{port}/api/version"
    out = {"mode": os.environ.get("RAY_AUTH_MODE"), "dashboard": ctx.dashboard_url}
    try:
        urllib.request.urlopen(url, timeout=10)
        out["anonymous"] = 200
    except urllib.error.HTTPError as err:
        out["anonymous"] = err.code
    token = open(os.path.expanduser("~/.ray/auth_token")).read().strip()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    out["with_token"] = urllib.request.urlopen(req, timeout=10).status
    out["dashboard_listen"] = sorted({c.laddr.ip for c in psutil.net_connections("inet")
                                      if c.status == "LISTEN" and c.laddr.port == port})
    ray.shutdown()
    print("RESULT " + json.dumps(out))
""")


def test_local_cluster_requires_a_token_and_binds_dashboard_to_loopback():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env["PYTHONPATH"] = str(ROOT)
    # Ray's temp dir (short: Ray's socket paths must fit 107 bytes) records a cluster that no longer exists
    tmp = tempfile.mkdtemp(prefix="rr", dir="/tmp")
    try:
        os.makedirs(os.path.join(tmp, "ray"))
        with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write("192.0.2.2:40477")  # TEST-NET-1: nothing answers there
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env={**env, "RAY_TMPDIR": tmp})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    line = next((s for s in out.stdout.splitlines() if s.startswith("RESULT ")), None)
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    assert result["mode"] == "token"
    assert result["anonymous"] == 401 and result["with_token"] == 200
    assert result["dashboard_listen"] == ["127.0.0.1"]
    assert result["dashboard"].startswith("127.0.0.1:")


def test_a_dashboard_port_in_use_gives_a_free_one_with_a_warning(caplog):
    """A second local run on the machine: Ray would stop with a traceback on the taken port."""
    import socket

    from actors.runtime import free_dashboard_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        with caplog.at_level("WARNING"):
            port = free_dashboard_port("127.0.0.1", taken)
        assert port != taken and f"ray.dashboard_port {taken}" in caplog.text
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # the port given is free to bind
    caplog.clear()
    assert free_dashboard_port("127.0.0.1", taken) == taken and not caplog.text  # free again: kept, no warning
