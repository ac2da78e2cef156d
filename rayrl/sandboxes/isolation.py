"""Command lines that start one exec inside a sandbox, per isolation level, and the probes that pick one.

Every exec is a fresh process tree in fresh namespaces over the sandbox's persistent working directory:

- ``bwrap``: bubblewrap with new user/mount/pid/net/ipc/uts namespaces. The new root holds read-only
  binds of /usr (and the /bin, /lib* links), a handful of /etc files (never /etc/shadow, never home
  directories or the project), the working directory read-write at /workspace, a private /tmp, /proc and
  a minimal /dev.
- ``unshare``: util-linux ``unshare`` plus a short shell script that builds the same root by hand
  (tmpfs, bind mounts, pivot_root) and drops every capability before running the command.
- ``none``: a plain child process in the working directory (trusted development only).

Network (``network_mode``): ``off`` (default) and ``proxy`` give each exec its own network namespace with
only a loopback interface and no route anywhere. ``proxy`` (``network: true`` with ``allowed_hosts``)
also bind-mounts the directory holding the host proxy's unix socket (netproxy.py) at ``/run/rayrl-net``
and starts the forwarder (netforward.py) on 127.0.0.1:3128 before the command, whose environment points
HTTP(S)_PROXY there. ``host`` (``network: true``, empty ``allowed_hosts``) shares the host's network.

Why each exec gets its own namespaces: the PID namespace dies with its first process, so when the
command ends, times out, or its launcher is killed, the kernel kills every descendant (background jobs,
``setsid``/``nohup`` escapes included). Nothing outlives an exec; state lives in the working directory.

Why a separate host uid when we are root: the kernel never enforces RLIMIT_NPROC for processes whose real
uid is root, even inside a user namespace, so a fork bomb would not be contained. As root we run the
sandbox under a dedicated unprivileged uid; RLIMIT_NPROC is then counted per user namespace, i.e. per
exec, which makes ``max_processes`` a per-sandbox limit. Limits are applied by ``prlimit`` *inside* the
namespace for that reason (set outside, NPROC would count every sandbox of that uid together).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable

from rayrl.config import SandboxConfig
from rayrl.sandboxes import netforward
from rayrl.sandboxes.base import SandboxUnavailable
from rayrl.sandboxes.fs import WORKSPACE

logger = logging.getLogger(__name__)

SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
INNER_UID = 1000  # the uid sandboxed code sees under bwrap (stable whatever host uid we run as)
MARKER_ENV = "RAYRL_SANDBOX"  # set on launcher processes so leftovers can be found and killed
STATUS_FD = "{status_fd}"  # replaced by the fd number of the status pipe when the launcher starts
SETUP_OK = "rayrl-sandbox-setup-ok:"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# /etc entries sandboxed programs need (dynamic linker cache, time zone, Debian alternatives, name
# service switch). Network-only entries are added when config.network is on.
_ETC_ALWAYS = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives", "nsswitch.conf",
               "protocols", "services")
_ETC_NETWORK = ("resolv.conf", "hosts", "ssl", "ca-certificates", "gai.conf", "host.conf")
_ETC_PROXY = ("ssl", "ca-certificates")  # TLS through the proxy's CONNECT needs the CA bundle, not DNS
PROXY_DIR = "/run/rayrl-net"  # where the proxy socket's directory appears inside the sandbox
PROXY_SOCKET = "proxy.sock"
PROXY_PORT = 3128  # the forwarder's port on the sandbox's own loopback
_FORWARDER_SOURCE = open(netforward.__file__).read()


def network_mode(config: SandboxConfig) -> str:
    """``off`` (loopback only), ``proxy`` (loopback + the filtering proxy) or ``host`` (host network)."""
    if not config.network:
        return "off"
    return "proxy" if config.allowed_hosts else "host"


def proxy_env() -> dict[str, str]:
    """Environment that sends HTTP clients to the forwarder. ``localhost`` stays the sandbox's own
    loopback; 127.0.0.1 goes through the proxy (so a rule like ``127.0.0.1:8000`` reaches the host's)."""
    url = f"http://127.0.0.1:{PROXY_PORT}"
    env = {"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
           "NO_PROXY": "localhost", "no_proxy": "localhost"}
    return env


def sandbox_python(other_uid: bool) -> str | None:
    """A python3 that exists inside the sandbox (for the forwarder), or None."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(path, os.X_OK):
            return path
    prefix = python_prefix(other_uid)
    return os.path.join(prefix, "bin", "python3") if prefix else None


def forwarder_argv(other_uid: bool) -> list[str]:
    """The prefix that starts the proxy forwarder, then execs the command that follows it."""
    python = sandbox_python(other_uid)
    if python is None:
        raise SandboxUnavailable("sandbox.allowed_hosts: the proxy forwarder needs python3 inside the "
                                 "sandbox (run scripts/install_system_deps.sh)")
    return [python, "-I", "-S", "-c", _FORWARDER_SOURCE, "rayrl-netfwd", str(PROXY_PORT),
            f"{PROXY_DIR}/{PROXY_SOCKET}"]


@dataclass(frozen=True)
class SandboxPaths:
    """Where a sandbox lives on the host."""

    root: str  # the sandbox's own directory

    @property
    def work(self) -> str:  # bound at /workspace
        return os.path.join(self.root, "work")

    @property
    def etc(self) -> str:  # generated passwd/group/hosts
        return os.path.join(self.root, "etc")

    @property
    def mnt(self) -> str:  # mount point of the new root (unshare mode; only inside the namespace)
        return os.path.join(self.root, "mnt")

    @property
    def tmp(self) -> str:  # TMPDIR of isolation none
        return os.path.join(self.root, "tmp")

    @property
    def net(self) -> str:  # holds the proxy's unix socket; bound read-only at PROXY_DIR (proxy mode)
        return os.path.join(self.root, "net")


@dataclass(frozen=True)
class Launch:
    """One exec's launcher: argv and the Popen settings that go with it."""

    argv: list[str]
    env: dict[str, str]  # the launcher's own environment (the command's is scrubbed separately)
    cwd: str | None = None
    uid: int | None = None  # switch to this host uid before exec (root only)
    status: str = ""  # how the launcher reports that setup succeeded: "bwrap-json", "stderr-nonce" or ""
    nonce: str = ""  # stderr-nonce: the first stderr line is f"{SETUP_OK}{nonce}" when setup succeeded
    contained: bool = True  # a PID namespace kills every descendant; False: leftovers must be hunted


def tool(name: str) -> str | None:
    """Absolute path of a host tool, searched on a fixed system PATH (not the caller's)."""
    return shutil.which(name, path=HOST_TOOL_PATH)


@functools.lru_cache(maxsize=1)
def _setpriv_pdeathsig() -> bool:
    """Whether setpriv can set a parent-death signal (util-linux >= 2.33)."""
    path = tool("setpriv")
    if path is None:
        return False
    out = subprocess.run([path, "--help"], capture_output=True, text=True).stdout
    return "--pdeathsig" in out


def die_with_caller() -> list[str]:
    """A prefix that kills the launcher when the calling thread's process dies (best effort)."""
    return [tool("setpriv") or "setpriv", "--pdeathsig=KILL", "--"] if _setpriv_pdeathsig() else []


def limits_argv(config: SandboxConfig, enforce_nproc: bool) -> list[str]:
    """``prlimit`` applying the config's limits to the command it then executes."""
    prlimit = tool("prlimit")
    if prlimit is None:
        raise SandboxUnavailable("prlimit (util-linux) not found: resource limits cannot be applied")
    mb = 1 << 20
    argv = [
        prlimit,
        f"--as={config.memory_mb * mb}",
        f"--cpu={config.cpu_seconds}:{config.cpu_seconds + 1}",
        f"--fsize={config.max_file_mb * mb}",
    ]
    if enforce_nproc:
        argv.append(f"--nproc={config.max_processes}")
    return argv + ["--"]


@functools.lru_cache(maxsize=2)
def python_prefix(other_uid: bool = False) -> str | None:
    """An interpreter prefix outside /usr to expose read-only, or None when /usr already has python3.

    The calculator tool and most agents need ``python3``. A system one under /usr is always bound. Only
    when there is none do we bind the prefix of the interpreter running us (e.g. a pyenv version
    directory) at the same path: that exposes one read-only Python installation, not its parents (a
    home directory stays invisible). When sandboxes run under another uid (we are root) the prefix must be
    reachable by that uid; a prefix under /root (0700) is not, and then there is no python3 inside: run
    scripts/install_system_deps.sh to get a system one.
    """
    if any(os.access(p, os.X_OK) for p in ("/usr/bin/python3", "/usr/local/bin/python3")):
        return None
    prefix = os.path.realpath(sys.base_prefix)
    if not os.access(os.path.join(prefix, "bin", "python3"), os.X_OK) or prefix.startswith("/usr/"):
        return None
    if other_uid and not searchable_by_others(os.path.join(prefix, "bin")):
        logger.warning("no python3 under /usr and %s is not reachable by the sandbox uid: sandboxed "
                       "commands will have no python3 (run scripts/install_system_deps.sh)", prefix)
        return None
    return prefix


def searchable_by_others(path: str) -> bool:
    """Whether every directory above ``path`` lets an unrelated uid pass through (o+x)."""
    current = os.path.dirname(os.path.abspath(path))
    while True:
        if not os.stat(current).st_mode & 0o001:
            return False
        if current == "/":
            return True
        current = os.path.dirname(current)


def _top_level_layout() -> tuple[list[tuple[str, str]], list[str]]:
    """(symlinks as (target, path), directories to bind) for /bin, /sbin and /lib*."""
    links, dirs = [], []
    for name in _TOP_LEVEL:
        path = "/" + name
        if os.path.islink(path):
            links.append((os.readlink(path), path))
        elif os.path.isdir(path):
            dirs.append(path)
    return links, dirs


def _etc_entries(mode: str) -> list[str]:
    names = _ETC_ALWAYS + {"off": (), "proxy": _ETC_PROXY, "host": _ETC_NETWORK}[mode]
    return [n for n in names if os.path.exists(os.path.join("/etc", n))]


def write_identity_files(paths: SandboxPaths, host_network: bool) -> None:
    """The sandbox's own passwd, group and (without the host network) hosts: no host account shows."""
    os.makedirs(paths.etc, mode=0o755, exist_ok=True)
    files = {
        "passwd": f"root:x:0:0:root:{WORKSPACE}:/bin/sh\n"
        f"sandbox:x:{INNER_UID}:{INNER_UID}:sandbox:{WORKSPACE}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsandbox:x:{INNER_UID}:\nnogroup:x:65534:\n",
    }
    if not host_network:
        files["hosts"] = "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    for name, text in files.items():
        with open(os.path.join(paths.etc, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(paths.etc, name), 0o644)


def _identity_names(mode: str) -> list[str]:
    return ["passwd", "group"] + ([] if mode == "host" else ["hosts"])


def command_env(home: str, extra: dict[str, str] | None, path_prefix: str | None = None) -> dict[str, str]:
    """The scrubbed environment a sandboxed command gets: PATH, HOME, LANG and the caller's extras."""
    path = SANDBOX_PATH if path_prefix is None else f"{path_prefix}:{SANDBOX_PATH}"
    env = {"PATH": path, "HOME": home, "LANG": "C.UTF-8"}
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ValueError(f"invalid environment variable name {key!r} (expected [A-Za-z_][A-Za-z0-9_]*)")
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"environment variable {key}: value must be a string without NUL")
        env[key] = value
    return env


def bwrap_launch(paths: SandboxPaths, config: SandboxConfig, cwd: list[str], env: dict[str, str],
                 cmd: list[str], marker: str, uid: int | None) -> Launch:
    """bubblewrap command line for one exec."""
    bwrap = tool("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed; run scripts/install_system_deps.sh")
    argv = [bwrap, "--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session",
            "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--json-status-fd", STATUS_FD]
    mode = network_mode(config)
    if mode != "host":
        argv.append("--unshare-net")
    argv += ["--ro-bind", "/usr", "/usr"]
    links, dirs = _top_level_layout()
    for target, path in links:
        argv += ["--symlink", target, path]
    for path in dirs:
        argv += ["--ro-bind", path, path]
    prefix = python_prefix(other_uid=uid is not None)
    if prefix is not None:
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--dir", "/etc"]
    for name in _etc_entries(mode):
        argv += ["--ro-bind", os.path.join("/etc", name), os.path.join("/etc", name)]
    for name in _identity_names(mode):
        argv += ["--ro-bind", os.path.join(paths.etc, name), os.path.join("/etc", name)]
    if mode == "proxy":
        argv += ["--ro-bind", paths.net, PROXY_DIR]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
             "--bind", paths.work, WORKSPACE, "--chdir", "/".join([WORKSPACE, *cwd]), "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    forwarder = forwarder_argv(uid is not None) if mode == "proxy" else []
    argv += ["--remount-ro", "/", "--", *limits_argv(config, enforce_nproc=True), *forwarder, *cmd]
    return Launch(argv=argv, env={"PATH": HOST_TOOL_PATH, MARKER_ENV: marker}, uid=uid, status="bwrap-json")


# Builds the new root inside fresh user+mount+pid namespaces, then runs "$@" without capabilities. The
# shell stays as PID 1 (the kernel shields PID 1 from signals, which user code should not inherit) and
# exits with the command's status; when it exits, the namespace and everything in it dies.
# Positional arguments: new-root mount point, working directory, cwd below /workspace, a nonce, then the
# command. The nonce line on stderr tells the caller that setup succeeded (so a setup error is never
# mistaken for the command's own failure); the caller removes it from the captured stderr.
_UNSHARE_SETUP = r"""
set -eu
R=$1; W=$2; C=$3; N=$4; shift 4
mount -t tmpfs -o mode=755,nosuid,nodev rayrl "$R"
cd "$R"
mkdir -p usr workspace tmp proc dev etc .old
rob() { mkdir -p "$R$2"; mount --rbind -o ro "$1" "$R$2"; }
rof() { : > "$R$2"; mount --bind -o ro "$1" "$R$2"; }
rob /usr /usr
%(layout)s
mount --bind "$W" "$R/workspace"
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
mount -t tmpfs -o mode=1777,nosuid,nodev tmp "$R/tmp"
mount -t tmpfs -o mode=755,nosuid dev "$R/dev"
for n in null zero full random urandom tty; do : > "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n"; done
ln -s /proc/self/fd "$R/dev/fd"; ln -s /proc/self/fd/0 "$R/dev/stdin"
ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
mkdir "$R/dev/shm"; mount -t tmpfs -o mode=1777,nosuid,nodev shm "$R/dev/shm"
pivot_root . .old
umount -l /.old
rmdir /.old
mount -o remount,bind,ro /
%(lo)s
cd "/workspace/$C"
printf '%%s%%s\n' "%(ok)s" "$N" >&2
set +e
"$@"
exit $?
"""


def _unshare_script(paths: SandboxPaths, config: SandboxConfig, other_uid: bool) -> str:
    q = shlex.quote
    lines = []
    links, dirs = _top_level_layout()
    for target, path in links:
        lines.append(f'ln -s {q(target)} "$R"{q(path)}')
    for path in dirs:
        lines.append(f"rob {q(path)} {q(path)}")
    prefix = python_prefix(other_uid)
    if prefix is not None:
        lines.append(f"rob {q(prefix)} {q(prefix)}")
    mode = network_mode(config)
    for name in _etc_entries(mode):
        host = os.path.join("/etc", name)
        lines.append(f"{'rob' if os.path.isdir(host) else 'rof'} {q(host)} {q(host)}")
    for name in _identity_names(mode):
        lines.append(f"rof {q(os.path.join(paths.etc, name))} {q('/etc/' + name)}")
    if mode == "proxy":
        lines.append(f"rob {q(paths.net)} {q(PROXY_DIR)}")
    lo = {"off": "if command -v ip >/dev/null; then ip link set lo up; fi", "host": "",
          "proxy": "ip link set lo up"}[mode]
    return _UNSHARE_SETUP % {"layout": "\n".join(lines), "lo": lo, "ok": SETUP_OK}


def unshare_launch(paths: SandboxPaths, config: SandboxConfig, cwd: list[str], env: dict[str, str],
                   cmd: list[str], marker: str, uid: int | None) -> Launch:
    """util-linux unshare command line for one exec (setup success is a nonce line on stderr)."""
    unshare, setpriv, env_tool = tool("unshare"), tool("setpriv"), tool("env")
    if unshare is None or setpriv is None or env_tool is None:
        raise SandboxUnavailable("util-linux unshare/setpriv not found: the unshare isolation cannot run")
    nonce = secrets.token_hex(8)
    flags = ["--user", "--map-root-user", "--mount", "--pid", "--fork", "--kill-child", "--ipc", "--uts",
             "--propagation", "private"]
    mode = network_mode(config)
    if mode != "host":
        flags.append("--net")
    if mode == "proxy" and tool("ip") is None:
        raise SandboxUnavailable("sandbox.allowed_hosts under isolation=unshare needs `ip` (iproute2) to "
                                 "bring up the sandbox's loopback; install it or use bwrap")
    forwarder = forwarder_argv(uid is not None) if mode == "proxy" else []
    inner = [setpriv, "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all", "--",
             env_tool, "-i", *(f"{k}={v}" for k, v in env.items()),
             *limits_argv(config, enforce_nproc=True), *forwarder, *cmd]
    argv = [*die_with_caller(), unshare, *flags, "--", "/bin/sh", "-c", _unshare_script(paths, config, uid is not None),
            "rayrl-sandbox-setup", paths.mnt, paths.work, "/".join(cwd), nonce, *inner]
    return Launch(argv=argv, env={"PATH": HOST_TOOL_PATH, MARKER_ENV: marker}, uid=uid,
                  status="stderr-nonce", nonce=nonce)


def none_launch(paths: SandboxPaths, config: SandboxConfig, cwd: list[str], env: dict[str, str],
                cmd: list[str], marker: str) -> Launch:
    """A plain child process: no isolation, limits except RLIMIT_NPROC (it would count all our processes)."""
    full_env = {**env, "TMPDIR": paths.tmp, MARKER_ENV: marker}
    argv = [*die_with_caller(), *limits_argv(config, enforce_nproc=False), *cmd]
    return Launch(argv=argv, env=full_env, cwd=os.path.join(paths.work, *cwd), contained=False)


_probe_lock = threading.Lock()
_probe_results: dict[str, str | None] = {}  # mode -> None (works) or the last reason it did not


def remember_probe(mode: str, run_probe: Callable[[], str | None]) -> str | None:
    """``run_probe()`` (None when ``mode`` works, else why not), remembered once it has succeeded.

    Only successes are remembered: a failure may be transient (a probe timing out on a loaded host), and
    remembering it would disable isolation for the life of the process.
    """
    with _probe_lock:
        if _probe_results.get(mode, "untested") is None:
            return None
        reason = run_probe()
        _probe_results[mode] = reason
        return reason
