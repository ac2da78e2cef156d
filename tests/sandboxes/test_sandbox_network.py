"""``network: true`` + ``allowed_hosts``: the sandbox reaches only the listed hosts, through the proxy.

Two real HTTP servers run on the host's loopback; sandboxes (bwrap and unshare) fetch through the proxy
with curl and python, are refused the other server, cannot bypass the proxy, and see only ``lo``. No
test traffic ever goes to an outside address (names used here resolve through /etc/hosts).
"""

from __future__ import annotations

import http.server
import os
import socket
import threading
import time

import pytest
from sbtest_helpers import ISOLATED, processes_matching

from rayrl.config import ConfigError, SandboxConfig, SandboxPoolConfig, load_config
from rayrl.sandboxes import netpolicy, open_sandbox
from rayrl.sandboxes.local import LocalSandbox
from rayrl.sandboxes.netproxy import SandboxProxy
from rayrl.sandboxes.pool import SandboxPool

PROXY = "http://127.0.0.1:3128"


class _Server:
    """A real HTTP server on host 127.0.0.1 that answers "hello from <tag> <path>" and logs requests."""

    def __init__(self, tag: str) -> None:
        self.requests: list[str] = []
        requests = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                requests.append(self.path)
                body = f"hello from {tag} {self.path}".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    a, b = _Server("A"), _Server("B")
    yield a, b
    a.close()
    b.close()


def _curl(sb: LocalSandbox, args: str) -> tuple[int, str, str]:
    r = sb.exec(f"curl -sS -m 10 -w ' HTTP%{{http_code}}' {args}", timeout=30)
    return r.exit_code, r.stdout, r.stderr


@pytest.mark.parametrize("mode", ISOLATED)
def test_only_allowed_host_is_reachable_through_the_proxy(make_sandbox, mode, servers):
    a, b = servers
    sb = make_sandbox(mode, network=True, allowed_hosts=[f"127.0.0.1:{a.port}"])
    # Allowed: plain HTTP through the proxy (curl, then python's urllib), and a CONNECT tunnel.
    code, out, err = _curl(sb, f"http://127.0.0.1:{a.port}/plain")
    assert code == 0 and out == "hello from A /plain HTTP200", (out, err)
    fetch = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{a.port}/py').read())"
    r = sb.exec(["python3", "-c", fetch], timeout=30)
    assert r.ok and "hello from A /py" in r.stdout, r.stderr
    code, out, err = _curl(sb, f"--proxytunnel http://127.0.0.1:{a.port}/tunnel")
    assert code == 0 and out.startswith("hello from A /tunnel"), (out, err)
    # Refused: B through the proxy, as plain HTTP and as CONNECT, with a 403 that says why.
    code, out, err = _curl(sb, f"http://127.0.0.1:{b.port}/denied")
    assert out.endswith("HTTP403") and f"127.0.0.1:{b.port} is not in sandbox.allowed_hosts" in out
    code, out, err = _curl(sb, f"--proxytunnel http://127.0.0.1:{b.port}/denied")
    assert code != 0 and "403" in err
    # Bypass: straight to A or B, with curl and with a raw socket. Nothing listens in the sandbox's own
    # loopback and there is no route out.
    for port in (a.port, b.port):
        code, out, err = _curl(sb, f"--noproxy '*' http://127.0.0.1:{port}/bypass")
        assert code != 0 and "hello" not in out
    for address in ("127.0.0.1", "10.0.0.1", "192.168.0.1"):  # no route: fails without sending anything
        raw = (f"import socket; socket.create_connection(('{address}', {a.port}), timeout=2); "
               "print('CONNECTED')")
        r = sb.exec(["python3", "-c", raw], timeout=20)
        assert r.exit_code != 0 and "CONNECTED" not in r.stdout
        assert any(w in r.stderr.lower() for w in ("refused", "unreachable")), r.stderr
    interfaces = [line.split(":")[0].strip() for line in sb.exec("cat /proc/net/dev").stdout.splitlines()[2:]]
    assert interfaces == ["lo"]
    assert not any(p in ("/denied", "/bypass") for p in a.requests + b.requests)
    assert a.requests == ["/plain", "/py", "/tunnel"] and b.requests == []
    stats = sb.network_stats()
    assert stats["allowed"] == 3 and stats["denied"] == 2


@pytest.mark.parametrize("mode", ISOLATED)
def test_proxy_env_and_no_dns_inside(make_sandbox, mode, servers):
    a, _ = servers
    sb = make_sandbox(mode, network=True, allowed_hosts=[f"127.0.0.1:{a.port}"])
    env = dict(line.split("=", 1) for line in sb.exec("env").stdout.splitlines() if "=" in line)
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert env[key] == PROXY
    assert env["NO_PROXY"] == "localhost"
    # Names are resolved by the proxy on the host; the sandbox has no resolver configuration.
    assert sb.exec("cat /etc/resolv.conf").exit_code != 0
    assert "127.0.0.1\tlocalhost" in sb.exec("cat /etc/hosts").stdout


def test_names_resolving_to_private_addresses_need_a_literal_rule(make_sandbox, servers):
    a, _ = servers
    via_proxy = f"-x {PROXY} --noproxy '' http://localhost:{a.port}/by-name"
    # "localhost" is allowed by name, but it resolves to loopback: refused (DNS rebinding defence).
    sb = make_sandbox("bwrap", network=True, allowed_hosts=[f"localhost:{a.port}"])
    code, out, _ = _curl(sb, via_proxy)
    assert out.endswith("HTTP403") and "non-public address" in out and a.requests == []
    # Naming the literal address too makes it reachable by name.
    sb = make_sandbox("bwrap", network=True, allowed_hosts=[f"localhost:{a.port}", f"127.0.0.1:{a.port}"])
    code, out, err = _curl(sb, via_proxy)
    assert code == 0 and out == "hello from A /by-name HTTP200", (out, err)


def test_wildcards_cover_subdomains_only(make_sandbox, servers):
    a, _ = servers
    sb = make_sandbox("bwrap", network=True, allowed_hosts=[f"*.localhost:{a.port}", f"127.0.0.1:{a.port}"])
    code, out, _ = _curl(sb, f"-x {PROXY} --noproxy '' http://localhost:{a.port}/bare")
    assert out.endswith("HTTP403") and "not in sandbox.allowed_hosts" in out
    policy = netpolicy.HostPolicy(netpolicy.parse_rules(["*.example.com", "api.test.org:8443"]))
    assert policy.rule_for("a.example.com", 443) and policy.rule_for("a.b.example.com", 80)
    assert not policy.rule_for("example.com", 443) and not policy.rule_for("badexample.com", 443)
    assert not policy.rule_for("a.example.com", 8080)  # no port in the rule: 80 and 443 only
    assert policy.rule_for("api.test.org", 8443) and not policy.rule_for("api.test.org", 443)


def test_address_checks():
    import ipaddress

    policy = netpolicy.HostPolicy(netpolicy.parse_rules(["127.0.0.1:8000", "[::1]:9000", "example.com"]))
    ip = ipaddress.ip_address
    assert policy.address_allowed(ip("93.184.216.34"), 443)
    assert policy.address_allowed(ip("127.0.0.1"), 8000) and not policy.address_allowed(ip("127.0.0.1"), 80)
    assert policy.address_allowed(ip("::ffff:127.0.0.1"), 8000)  # mapped addresses are unwrapped
    assert policy.address_allowed(ip("::1"), 9000)
    for private in ("10.1.2.3", "192.168.1.1", "169.254.169.254", "0.0.0.0", "::1", "fd00::1"):
        assert not policy.address_allowed(ip(private), 80), private
    assert netpolicy.normalise_host("[::FFFF:127.0.0.1]") == "127.0.0.1"
    assert netpolicy.normalise_host("Example.COM.") == "example.com"


def test_proxy_and_forwarder_die_with_the_exec_and_the_sandbox(make_sandbox, servers):
    a, _ = servers
    sb = make_sandbox("bwrap", network=True, allowed_hosts=[f"127.0.0.1:{a.port}"])
    r = sb.exec("sleep 300 & curl -sS http://127.0.0.1:%d/; sleep 300" % a.port, timeout=1.5)
    assert r.timed_out and "hello from A" in r.stdout
    assert processes_matching("rayrl-netfwd") == []
    sock = os.path.join(sb.paths.net, "proxy.sock")
    assert os.path.exists(sock)
    sb.close()
    assert not os.path.exists(sock)
    probe = socket.socket(socket.AF_UNIX)
    with pytest.raises(OSError):
        probe.connect(sock)
    probe.close()


def test_pool_reset_and_recycle_keep_the_proxy_working(sandbox_root, servers):
    a, b = servers
    config = SandboxConfig(isolation="bwrap", network=True, allowed_hosts=[f"127.0.0.1:{a.port}"])
    pool = SandboxPool(config, SandboxPoolConfig(min_warm=1, max_size=1, recycle_after=2),
                       factory=lambda: LocalSandbox(config, root=sandbox_root))
    seen = []
    try:
        for i in range(3):  # leases 1 and 2 share a sandbox (reset between), lease 3 gets a new one
            lease = pool.acquire("worker")
            seen.append(lease.handle.sandbox_id)
            user = open_sandbox(lease.handle)  # a rollout worker opens the handle in its own process
            ok = user.exec(f"curl -sS http://127.0.0.1:{a.port}/lease{i}", timeout=20)
            denied = user.exec(f"curl -sS -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{b.port}/",
                               timeout=20)
            assert ok.stdout == f"hello from A /lease{i}" and denied.stdout == "403", (ok, denied)
            user.close()
            pool.release(lease.lease_id)
        assert seen[0] == seen[1] != seen[2]
        assert pool.stats()["recycled"] == 1
    finally:
        pool.shutdown()
    assert [n for n in os.listdir(sandbox_root) if n in seen] == []


def test_host_network_without_allowed_hosts_is_shared_and_warned(make_sandbox, monkeypatch, caplog):
    from rayrl.sandboxes import local

    monkeypatch.setattr(local, "_warned_host_network", False)
    with caplog.at_level("WARNING"):
        sb = make_sandbox("bwrap", network=True)
        make_sandbox("bwrap", network=True)
    assert sum("UNFILTERED" in r.getMessage() for r in caplog.records) == 1
    host_ifaces = {line.split(":")[0].strip() for line in open("/proc/net/dev").read().splitlines()[2:]}
    inside = {line.split(":")[0].strip() for line in sb.exec("cat /proc/net/dev").stdout.splitlines()[2:]}
    assert inside == host_ifaces  # the host's network namespace, as documented


@pytest.mark.parametrize("entry", ["http://example.com", "exa mple.com", "example.com:0", "example.com:http",
                                   "*", "*.", "a.*.com", "::1", "[::1", "[nothost]:80", "-bad-.com", ""])
def test_bad_allowed_hosts_entries_are_config_errors(entry, sandbox_root):
    with pytest.raises(ConfigError, match=r"sandbox\.allowed_hosts\[0\]"):
        load_config(overrides=["sandbox.network=true", f"sandbox.allowed_hosts=[{entry!r}]"])
    with pytest.raises(ConfigError, match=r"sandbox\.allowed_hosts\[0\]"):
        LocalSandbox(SandboxConfig(isolation="bwrap", network=True, allowed_hosts=[entry]), root=sandbox_root)


def test_allowed_hosts_need_the_network_on():
    with pytest.raises(ConfigError, match="sandbox.allowed_hosts.*sandbox.network"):
        load_config(overrides=["sandbox.allowed_hosts=[example.com]"])
    cfg = load_config(overrides=["sandbox.network=true",
                                 "sandbox.allowed_hosts=[example.com,'*.b.org:8443']"])
    assert cfg.sandbox.allowed_hosts == ["example.com", "*.b.org:8443"]


def _ask(sock_path: str, request: bytes) -> bytes:
    client = socket.socket(socket.AF_UNIX)
    client.settimeout(10)
    client.connect(sock_path)
    client.sendall(request)
    chunks = []
    while chunk := client.recv(65536):
        chunks.append(chunk)
    client.close()
    return b"".join(chunks)


def test_malformed_proxy_requests_get_4xx_not_a_crash(tmp_path, servers):
    a, _ = servers
    sock = str(tmp_path / "p.sock")
    proxy = SandboxProxy(sock, netpolicy.HostPolicy(netpolicy.parse_rules([f"127.0.0.1:{a.port}"])), "t")
    try:
        for request in (b"garbage\r\n\r\n", b"GET /origin-form HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"GET https://127.0.0.1/ HTTP/1.1\r\n\r\n", b"CONNECT 127.0.0.1 HTTP/1.1\r\n\r\n",
                        b"CONNECT [::1:80 HTTP/1.1\r\n\r\n", b"GET http://127.0.0.1:99999/ HTTP/1.1\r\n\r\n"):
            assert _ask(sock, request).startswith(b"HTTP/1.1 400 "), request
        huge = b"GET http://127.0.0.1/ HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n"
        assert _ask(sock, huge).startswith(b"HTTP/1.1 431 ")
        ok = _ask(sock, f"GET http://127.0.0.1:{a.port}/raw HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert ok.startswith(b"HTTP/1.0 200") and ok.endswith(b"hello from A /raw")
        assert proxy.stats() == {"allowed": 1, "denied": 0, "failed": 0, "bad_requests": 7, "over_limit": 0}
    finally:
        proxy.close()
    assert not os.path.exists(sock)


def test_open_connections_per_sandbox_are_capped(tmp_path):
    from rayrl.sandboxes import netproxy

    sock = str(tmp_path / "p.sock")
    proxy = SandboxProxy(sock, netpolicy.HostPolicy(()), "t")
    held = []
    try:
        for _ in range(netproxy._MAX_CONNECTIONS):  # idle clients that never send a request
            client = socket.socket(socket.AF_UNIX)
            client.connect(sock)
            held.append(client)
        deadline = time.monotonic() + 10
        while len(proxy._writers) < netproxy._MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.05)
        extra = socket.socket(socket.AF_UNIX)
        extra.settimeout(10)
        extra.connect(sock)
        assert extra.recv(100) == b""  # closed at once
        extra.close()
        assert proxy.stats()["over_limit"] == 1
    finally:
        for client in held:
            client.close()
        proxy.close()
