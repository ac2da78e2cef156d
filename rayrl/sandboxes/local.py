"""LocalSandbox: a private working directory on this node; every command runs isolated from the host.

Isolation (``config.isolation``): ``bwrap`` and ``unshare`` put each exec in new user/mount/pid/net/ipc/
uts namespaces (see isolation.py); ``none`` runs plain child processes and is for trusted development
only; ``auto`` takes bwrap, else unshare, else raises SandboxUnavailable naming what is missing. It never
falls back to running unisolated.

Lifetime: the creating process owns the directory (``close()`` removes it). Another process on the node
reopens the sandbox from its handle (``LocalSandbox.attach``/``open_sandbox``) and runs commands itself;
if the handle carries a lease id, the reopened sandbox stops working as soon as that lease ends, so a
late episode can never touch the next episode's files or processes.

Network: off by default (each exec has its own network namespace, loopback only). ``network: true`` with
``allowed_hosts`` keeps that namespace and adds one way out, a filtering HTTP/CONNECT proxy owned by this
object (netproxy.py) that only reaches the listed hosts; ``network: true`` with an empty
``allowed_hosts`` shares the host's network, unfiltered (logged loudly).

Known limits: no disk quota (RLIMIT_FSIZE bounds one file, not the total); no seccomp filter; with a
proxy, only clients that speak HTTP proxying (HTTP_PROXY/HTTPS_PROXY) get out; raw TCP and UDP have no route.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any

from rayrl.config import ConfigError, SandboxConfig
from rayrl.sandboxes import fs, isolation, netpolicy, procs
from rayrl.sandboxes.base import (
    DEFAULT_MAX_OUTPUT_BYTES,
    ExecResult,
    SandboxError,
    SandboxHandle,
    SandboxUnavailable,
    truncate_output,
)
from rayrl.sandboxes.isolation import SETUP_OK, SandboxPaths
from rayrl.sandboxes.netproxy import SandboxProxy

logger = logging.getLogger(__name__)

_UID_BASE, _UID_SPAN = 2_000_000, 1_000_000  # host uids for sandboxes when we are root
_PROBE_TIMEOUT_S = 30.0
_warned_none = False
_warned_host_network = False


@functools.lru_cache(maxsize=1)
def _node_id() -> str:
    """This machine's identity (hostname + boot id): local handles are only valid on their node."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _process_identity(pid: int) -> str | None:
    """"<pid> <start time>" of a live process, or None: a pid alone could have been reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return f"{pid} {start}"


def remove_orphans(root: str | None = None) -> int:
    """Remove sandboxes under ``root`` whose creating process is gone (a crashed pool); returns how many.

    Their running commands are killed first. Sandboxes of live processes are left alone.
    """
    base = os.path.abspath(root or default_root())
    removed = 0
    try:
        names = [n for n in os.listdir(base) if n.startswith("sb-")]
    except FileNotFoundError:
        return 0
    for name in names:
        try:
            with open(os.path.join(base, name, "owner")) as f:
                owner = f.read().strip()
        except OSError:
            continue  # being created or removed right now
        pid = owner.split()[0] if owner else ""
        if pid.isdigit() and _process_identity(int(pid)) == owner:
            continue
        procs.kill_marked(f"{name}:")
        fs.remove_tree(os.path.join(base, name))
        removed += 1
    if removed:
        logger.warning("removed %d orphaned sandbox(es) under %s", removed, base)
    return removed


def default_root() -> str:
    """Where sandboxes live unless told otherwise: a 0711 directory in the system temp dir."""
    return os.path.join(tempfile.gettempdir(), "rayrl-sandboxes")


def _warn_unisolated() -> None:
    global _warned_none
    if not _warned_none:
        _warned_none = True
        logger.warning(
            "!!! sandbox.isolation=none: commands run UNISOLATED on this host with your privileges "
            "(no namespaces, no network or filesystem isolation, RLIMIT_NPROC not applied). "
            "Use it only for trusted development. !!!"
        )


def _warn_host_network() -> None:
    global _warned_host_network
    if not _warned_host_network:
        _warned_host_network = True
        logger.warning(
            "!!! sandbox.network=true with empty sandbox.allowed_hosts: sandboxed commands share this "
            "host's network UNFILTERED (any address, the host's loopback services included). List the "
            "hosts they need in sandbox.allowed_hosts to get a filtering proxy instead. !!!"
        )


def _network_policy(config: SandboxConfig) -> netpolicy.HostPolicy | None:
    """The allow-list when the proxy is in use (validated: ConfigError names the field), else None."""
    if isolation.network_mode(config) != "proxy":
        return None
    try:
        rules = netpolicy.parse_rules(list(config.allowed_hosts))
    except ValueError as err:
        raise ConfigError(f"sandbox.allowed_hosts{err}") from None
    if config.isolation == "none":
        raise SandboxUnavailable("sandbox.allowed_hosts cannot be enforced with sandbox.isolation=none "
                                 "(no network namespace); use bwrap/unshare or drop allowed_hosts")
    return netpolicy.HostPolicy(rules)


class LocalSandbox:
    """A sandbox on this node (see the module docstring for isolation and lifetime)."""

    def __init__(self, config: SandboxConfig, root: str | None = None,
                 max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> None:
        policy = _network_policy(config)
        if isolation.network_mode(config) == "host":
            _warn_host_network()
        if max_output_bytes <= 0:
            raise ValueError("max_output_bytes must be > 0")
        self.config = config
        self.max_output_bytes = max_output_bytes
        self._sandbox_id = "sb-" + secrets.token_hex(8)
        self._owner = True
        self._lease_id: str | None = None
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._proxy: SandboxProxy | None = None
        switch_uid = os.geteuid() == 0 and config.isolation != "none"
        self.uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if switch_uid else None
        base = os.path.abspath(root or default_root())
        os.makedirs(base, mode=0o711, exist_ok=True)
        if root is None and switch_uid:
            os.chmod(base, 0o711)
        self.paths = SandboxPaths(os.path.join(base, self._sandbox_id))
        try:
            os.mkdir(self.paths.root, 0o711 if switch_uid else 0o700)
            for d in (self.paths.mnt, self.paths.tmp):
                os.mkdir(d, 0o755)
            isolation.write_identity_files(self.paths, isolation.network_mode(config) == "host")
            with open(os.path.join(self.paths.root, "owner"), "w") as f:
                f.write(_process_identity(os.getpid()) or "")
            self._make_workdir()
            if policy is not None:
                self._start_proxy(policy)
            self.isolation = self._resolve_isolation(config.isolation)
            self._preload()
        except BaseException:
            if self._proxy is not None:
                self._proxy.close()
            fs.remove_tree(self.paths.root)
            raise

    @classmethod
    def attach(cls, handle: SandboxHandle) -> "LocalSandbox":
        """Reopen a sandbox created by another process on this node (does not own its directory)."""
        node = handle.options.get("node")
        if node is not None and node != _node_id():
            raise SandboxError(f"sandbox {handle.sandbox_id} lives on node {node}, this process runs on "
                               f"{_node_id()}: local sandboxes are used on the node whose pool made them")
        if handle.root is None or not os.path.isdir(os.path.join(handle.root, "work")):
            raise SandboxError(f"sandbox {handle.sandbox_id} does not exist on this node ({handle.root})")
        self = cls.__new__(cls)
        self.config = handle.config
        self.max_output_bytes = int(handle.options.get("max_output_bytes", DEFAULT_MAX_OUTPUT_BYTES))
        self._sandbox_id = handle.sandbox_id
        self._owner = False
        self._lease_id = handle.options.get("lease_id")
        self._running = set()
        self._lock = threading.Lock()
        self._closed = False
        self._proxy = None  # the creator's proxy serves every opener through the shared socket
        self.uid = handle.options.get("uid")
        self.paths = SandboxPaths(handle.root)
        self.isolation = handle.options["isolation"]
        if self.isolation == "none":
            _warn_unisolated()
        self._check_lease()
        return self

    # ----------------------------------------------------------------------------------------- identity
    @property
    def sandbox_id(self) -> str:
        return self._sandbox_id

    def handle(self) -> SandboxHandle:
        """Picklable handle; the pool adds ``lease_id`` to its options for each lease."""
        options: dict[str, Any] = {"isolation": self.isolation, "uid": self.uid, "node": _node_id(),
                                   "max_output_bytes": self.max_output_bytes}
        if self._lease_id is not None:
            options["lease_id"] = self._lease_id
        return SandboxHandle("local", self._sandbox_id, self.paths.root, self.config, options)

    def set_lease(self, lease_id: str | None) -> None:
        """Record the current lease (owner only): reopened handles of any other lease stop working."""
        self._require_owner("set_lease")
        self._lease_id = lease_id
        # Raw os calls: this runs on every lease grant, on the pool actor's event loop.
        tmp = os.path.join(self.paths.root, "lease.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, (lease_id or "").encode())
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(self.paths.root, "lease"))

    def network_stats(self) -> dict[str, int]:
        """Connections the proxy allowed and denied (owner, proxy mode; zeros otherwise)."""
        if self._proxy is None:
            return {"allowed": 0, "denied": 0, "failed": 0, "bad_requests": 0, "over_limit": 0}
        return self._proxy.stats()

    # ----------------------------------------------------------------------------------------- commands
    def exec(self, cmd: str | list[str], timeout: float | None = None, env: dict[str, str] | None = None,
             cwd: str | None = None) -> ExecResult:
        """Run ``cmd`` isolated; the whole process tree is dead when this returns (see isolation.py)."""
        self._check_usable()
        argv = self._argv(cmd)
        timeout_s = self.config.timeout_s if timeout is None else float(timeout)
        if not timeout_s > 0:
            raise SandboxError(f"exec timeout must be > 0, got {timeout!r}")
        cwd_names = fs.resolve_cwd(self.paths.work, cwd)
        marker = f"{self._sandbox_id}:{secrets.token_hex(6)}"
        try:
            launch = self._launch(self.isolation, argv, env, cwd_names, marker)
        except ValueError as err:
            raise SandboxError(str(err)) from None
        started = time.monotonic()
        try:
            captured = procs.run_launch(launch, timeout_s, self.max_output_bytes, marker, self._on_spawn)
        except OSError as err:
            raise SandboxError(f"sandbox {self._sandbox_id}: cannot start {launch.argv[0]}: {err}") from None
        finally:
            with self._lock:
                self._running = {p for p in self._running if p.returncode is None}
        duration = time.monotonic() - started
        if self._closed:
            raise SandboxError(f"sandbox {self._sandbox_id} was closed while the command ran")
        self._check_lease()  # a release/expiry during the command killed it: say so, not "exit 137"
        stderr, stderr_total = captured.stderr, captured.stderr_total
        if launch.status == "bwrap-json" and b'"child-pid"' not in captured.status and not captured.timed_out:
            raise SandboxError(f"sandbox {self._sandbox_id}: bwrap could not start: "
                               f"{stderr.decode(errors='replace').strip()[:2000]}")
        if launch.status == "stderr-nonce":
            line = f"{SETUP_OK}{launch.nonce}\n".encode()
            at = stderr.find(line)
            if at < 0 and not captured.timed_out:
                raise SandboxError(f"sandbox {self._sandbox_id}: unshare setup failed: "
                                   f"{stderr.decode(errors='replace').strip()[:2000]}")
            if at >= 0:
                stderr, stderr_total = stderr[at + len(line):], stderr_total - at - len(line)
        code = captured.returncode
        if code < 0:
            code = 128 - code
        if captured.timed_out:
            code = 137
        return ExecResult(
            exit_code=code,
            stdout=truncate_output(captured.stdout, captured.stdout_total, self.max_output_bytes),
            stderr=truncate_output(stderr, stderr_total, self.max_output_bytes),
            timed_out=captured.timed_out,
            duration_s=duration,
        )

    # ------------------------------------------------------------------------------------------- files
    def write_file(self, path: str, data: bytes) -> None:
        """Write a file under the working directory (``/workspace`` inside); escapes are refused."""
        self._check_usable()
        fs.write_file(self.paths.work, path, data, self._file_owner())

    def read_file(self, path: str) -> bytes:
        """Read a regular file under the working directory; escapes and symlinks are refused."""
        self._check_usable()
        return fs.read_file(self.paths.work, path)

    # --------------------------------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Kill everything this sandbox runs (any process's execs) and restore a fresh working directory."""
        self._require_owner("reset")
        self._check_usable()
        self._kill_all()
        if self._proxy is not None:
            self._proxy.drop_connections()
        fs.remove_tree(self.paths.work)
        self._make_workdir()
        self._preload()

    def close(self) -> None:
        """Kill what is running; the owner also kills other processes' execs and removes the directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._kill_all()
        if self._proxy is not None:
            self._proxy.close()
        if self._owner:
            fs.remove_tree(self.paths.root)

    def __enter__(self) -> "LocalSandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalSandbox({self._sandbox_id}, isolation={self.isolation}, root={self.paths.root})"

    # -------------------------------------------------------------------------------------- internals
    def _argv(self, cmd: str | list[str]) -> list[str]:
        if isinstance(cmd, str):
            return ["/bin/sh", "-c", cmd]
        if isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd):
            if any("\0" in a for a in cmd):
                raise SandboxError("command arguments must not contain NUL")
            return list(cmd)
        raise SandboxError(f"cmd must be a string or a non-empty list of strings, got {cmd!r}")

    def _launch(self, mode: str, argv: list[str], env: dict[str, str] | None, cwd: list[str],
                marker: str) -> isolation.Launch:
        prefix = isolation.python_prefix(other_uid=self.uid is not None)
        path_prefix = os.path.join(prefix, "bin") if prefix else None
        if mode == "none":
            cmd_env = isolation.command_env(self.paths.work, env, path_prefix)
            return isolation.none_launch(self.paths, self.config, cwd, cmd_env, argv, marker)
        if isolation.network_mode(self.config) == "proxy":
            env = {**isolation.proxy_env(), **(env or {})}
        cmd_env = isolation.command_env(fs.WORKSPACE, env, path_prefix)
        build = isolation.bwrap_launch if mode == "bwrap" else isolation.unshare_launch
        return build(self.paths, self.config, cwd, cmd_env, argv, marker, uid=self.uid)

    def _on_spawn(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.add(proc)
            closed = self._closed
        if closed:
            raise SandboxError(f"sandbox {self._sandbox_id} was closed")
        self._check_lease()  # re-checked after the spawn: a release racing with this exec kills it

    def _check_usable(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self._sandbox_id} is closed")
        if not os.path.isdir(self.paths.root):  # destroyed under us: an infrastructure failure, not a command's
            raise SandboxError(f"sandbox {self._sandbox_id} is gone: {self.paths.root} no longer exists")
        self._check_lease()

    def _check_lease(self) -> None:
        if self._owner or self._lease_id is None:
            return
        try:
            with open(os.path.join(self.paths.root, "lease")) as f:
                current = f.read()
        except FileNotFoundError:
            current = ""
        if current != self._lease_id:
            raise SandboxError(f"sandbox {self._sandbox_id}: lease {self._lease_id} has ended "
                               "(released, expired or reclaimed)")

    def _require_owner(self, what: str) -> None:
        if not self._owner:
            raise SandboxError(
                f"{what}: only the process that created sandbox {self._sandbox_id} may do this")

    def _file_owner(self) -> tuple[int, int] | None:
        return (self.uid, self.uid) if self.uid is not None else None

    def _start_proxy(self, policy: netpolicy.HostPolicy) -> None:
        """The sandbox's filtering proxy, on a socket only the sandbox uid (or we) may connect to."""
        isolation.forwarder_argv(self.uid is not None)  # fail now, not at the first exec, without python3
        os.mkdir(self.paths.net, 0o755)
        sock = os.path.join(self.paths.net, isolation.PROXY_SOCKET)
        try:
            self._proxy = SandboxProxy(sock, policy, self._sandbox_id, owner_uid=self.uid)
        except ValueError as err:
            raise SandboxUnavailable(str(err)) from None

    def _make_workdir(self) -> None:
        os.mkdir(self.paths.work, 0o700)
        if self.uid is not None:
            os.chown(self.paths.work, self.uid, self.uid)

    def _preload(self) -> None:
        for path, content in self.config.files.items():
            fs.write_file(self.paths.work, path, content.encode(), self._file_owner())

    def _kill_all(self) -> None:
        with self._lock:
            running = list(self._running)
        for proc in running:
            procs.kill_group(proc)
        if self._owner:
            procs.kill_marked(f"{self._sandbox_id}:")

    def _resolve_isolation(self, requested: str) -> str:
        if requested == "none":
            _warn_unisolated()
            return "none"
        if requested not in ("auto", "bwrap", "unshare"):
            raise SandboxError(f"sandbox.isolation: unknown level {requested!r}")
        if self.uid is not None and not isolation.searchable_by_others(self.paths.work):
            raise SandboxUnavailable(
                f"sandbox root {os.path.dirname(self.paths.root)}: a parent directory lacks o+x, so the "
                "unprivileged sandbox uid cannot reach its working directory; choose a root under /tmp"
            )
        reasons = []
        for mode in (("bwrap", "unshare") if requested == "auto" else (requested,)):
            reason = isolation.remember_probe(mode, lambda m=mode: self._probe(m))
            if reason is None:
                return mode
            reasons.append(f"{mode}: {reason}")
        raise SandboxUnavailable(
            "no sandbox isolation is available here (" + "; ".join(reasons) + "). Install bubblewrap "
            "(scripts/install_system_deps.sh) or allow user namespaces; sandbox.isolation=none runs "
            "commands unisolated and is for trusted development only"
        )

    def _probe(self, mode: str) -> str | None:
        """None when ``mode`` runs ``true`` here, else why not (naming the missing capability)."""
        needed = {"bwrap": ("bwrap", "prlimit"), "unshare": ("unshare", "setpriv", "prlimit", "env")}[mode]
        missing = [t for t in needed if isolation.tool(t) is None]
        if missing:
            hint = " (apt-get install bubblewrap)" if "bwrap" in missing else ""
            return f"{', '.join(missing)} not installed{hint}"
        self.isolation = mode
        try:
            result = self.exec(["true"], timeout=_PROBE_TIMEOUT_S)
        except SandboxError as err:
            text = str(err)
            if "setting up uid map" in text or "Operation not permitted" in text or "No permissions" in text:
                text += " [user namespaces are not permitted here: check kernel.unprivileged_userns_clone, " \
                        "user.max_user_namespaces, or the container's seccomp/AppArmor profile]"
            return text
        if not result.ok:
            return f"a trivial command failed (exit {result.exit_code}): {result.stderr.strip()[:500]}"
        return None
