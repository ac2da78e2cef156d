"""Running one launcher process: capture capped output, enforce the wall clock, kill what is left.

Separate from the sandbox class so the hard parts (pipes that stay open after the main process exits,
killing a process tree whose members left our process group) are in one readable place.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from rayrl.sandboxes.isolation import MARKER_ENV, SETUP_OK, STATUS_FD, Launch

_TICK_S = 0.05  # how often a quiet exec checks whether its main process is gone
_DRAIN_GRACE_S = 1.0  # after a kill, how long we keep reading what is still buffered in the pipes
_NAMESPACE_EXIT_WAIT_S = 5.0  # bound on waiting for a killed PID namespace to finish dying


@dataclass
class Captured:
    """Raw result of one launcher run."""

    returncode: int
    stdout: bytes
    stderr: bytes
    stdout_total: int
    stderr_total: int
    status: bytes
    timed_out: bool


def kill_marked(prefix: str) -> int:
    """SIGKILL every process whose environment holds ``RAYRL_SANDBOX=<prefix>...``; returns how many.

    Launchers carry the marker, so this finds an exec's processes even when they were started by another
    process (the rollout worker) or escaped their process group with setsid (isolation none). A pidfd is
    taken before the environment is read, so a recycled pid is never signalled.
    """
    needle = f"\0{MARKER_ENV}={prefix}".encode()
    me = os.getpid()
    killed = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            pidfd = os.pidfd_open(int(name))
        except OSError:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = b"\0" + f.read()
            if needle in environ:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                killed += 1
        except OSError:
            pass
        finally:
            os.close(pidfd)
    return killed


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the launcher's process group (the launcher leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_launch(launch: Launch, timeout_s: float, cap: int, marker: str,
               on_spawn: Callable[[subprocess.Popen], None] | None = None) -> Captured:
    """Run ``launch`` to completion or until ``timeout_s``; everything it started is dead on return.

    ``on_spawn(proc)`` runs right after the launcher starts (the sandbox tracks it for close()); if it
    raises, the launch is killed and the error propagates. Call this from the thread that waits for the
    result: the launcher's parent-death signal fires when the *thread* that started it exits.
    """
    status_r, status_w = os.pipe()
    kwargs: dict = {}
    if launch.uid is not None:
        kwargs.update(user=launch.uid, group=launch.uid, extra_groups=[])
    argv = [str(status_w) if a == STATUS_FD else a for a in launch.argv]
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=launch.env, cwd=launch.cwd, start_new_session=True, close_fds=True,
            pass_fds=(status_w,) if launch.status == "bwrap-json" else (), **kwargs,
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    if on_spawn is not None:
        try:
            on_spawn(proc)
        except BaseException:  # the exec may not go on (e.g. its lease ended): nothing may survive it
            kill_group(proc)
            kill_marked(marker)
            proc.communicate()
            os.close(status_r)
            raise
    # stderr keeps a little headroom for the unshare setup line, which the caller strips.
    err_cap = cap + len(SETUP_OK) + len(launch.nonce) + 1 if launch.status == "stderr-nonce" else cap
    return _collect(proc, status_r, time.monotonic() + timeout_s, cap, err_cap, marker,
                    orphans_possible=not launch.contained)


def _wait_namespace_gone(status: bytes) -> None:
    """Under bwrap, return only once the PID namespace's init is gone.

    bwrap's launcher exits as soon as it knows the command's exit code, while the namespace init (already
    SIGKILLed through --die-with-parent) may still be tearing the namespace down for a few milliseconds.
    The kernel lets an init finish exiting only after every process in its namespace is gone, so waiting
    for it makes "nothing outlives the exec" exact rather than eventual.
    """
    for line in status.splitlines():
        if b'"child-pid"' not in line:
            continue
        try:
            pid = int(json.loads(line)["child-pid"])
            pidfd = os.pidfd_open(pid)
        except (ValueError, KeyError, OSError):
            return  # already gone (or unparsable: bwrap printed it, so the launcher started fine)
        try:
            select.select([pidfd], [], [], _NAMESPACE_EXIT_WAIT_S)
        finally:
            os.close(pidfd)
        return


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the launcher has exited, without reaping it (its pid, hence its group, stays reserved)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _collect(proc: subprocess.Popen, status_r: int, deadline: float, cap: int, err_cap: int,
             marker: str, orphans_possible: bool) -> Captured:
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
    caps = {out_fd: cap, err_fd: err_cap, status_r: 1 << 16}
    totals = dict.fromkeys(bufs, 0)
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    timed_out = False
    exited_at: float | None = None
    hard_stop: float | None = None  # once set, stop reading at this time whatever is still open
    try:
        while sel.get_map():
            now = time.monotonic()
            if hard_stop is None and now >= deadline:
                timed_out = True
                kill_group(proc)
                kill_marked(marker)
                hard_stop = now + _DRAIN_GRACE_S
            if hard_stop is not None and now >= hard_stop:
                break
            wait = min(_TICK_S, (hard_stop or deadline) - now)
            for key, _ in sel.select(max(wait, 0.0)):
                fd = key.fd
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                totals[fd] += len(chunk)
                room = caps[fd] - len(bufs[fd])
                if room > 0:
                    bufs[fd] += chunk[:room]
            if hard_stop is None and sel.get_map() and _exited(proc):
                # The main process is gone but something still holds a pipe (a background job under
                # isolation none): nothing may outlive the exec, so kill the rest and drain.
                exited_at = exited_at or time.monotonic()
                if time.monotonic() - exited_at >= _TICK_S:
                    kill_group(proc)
                    kill_marked(marker)
                    hard_stop = time.monotonic() + _DRAIN_GRACE_S
    finally:
        sel.close()
        os.close(status_r)
        proc.stdout.close()
        proc.stderr.close()
    if orphans_possible or not _exited(proc):
        kill_group(proc)  # before reaping, so the group id cannot have been reused
    if orphans_possible:
        kill_marked(marker)
    returncode = proc.wait()
    _wait_namespace_gone(bytes(bufs[status_r]))
    return Captured(
        returncode=returncode, stdout=bytes(bufs[out_fd]), stderr=bytes(bufs[err_fd]),
        stdout_total=totals[out_fd], stderr_total=totals[err_fd], status=bytes(bufs[status_r]),
        timed_out=timed_out,
    )
