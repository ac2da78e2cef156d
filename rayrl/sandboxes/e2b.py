"""E2BSandbox: the same Sandbox protocol over an e2b.dev cloud sandbox (the ``e2b`` Python SDK).

For runs where commands must not execute on the training node at all. The SDK is imported lazily so the
rest of rayrl does not depend on it; the API key comes from ``E2B_API_KEY`` and the template from
``config.image``. Isolation and limits are the provider's: the local limits in SandboxConfig
(memory_mb, cpu_seconds, ...) do not apply here, only ``timeout_s`` does. ``network: false`` creates the
sandbox without internet access; ``allowed_hosts`` is refused (not silently ignored): e2b's egress
rules do not have the same meaning (ports, wildcards, the anti-rebinding check), so they are not mapped.

Tested against tests/sandboxes/e2b_fake.py, a local fake of e2b's REST API and envd speaking their wire
protocols through the real SDK; never against the e2b cloud here (no API key).
"""

from __future__ import annotations

import os
import posixpath
import shlex
import time
from typing import Any

from rayrl.config import SandboxConfig
from rayrl.sandboxes.base import (
    DEFAULT_MAX_OUTPUT_BYTES,
    ExecResult,
    SandboxError,
    SandboxHandle,
    SandboxUnavailable,
    truncate_output,
)
from rayrl.sandboxes.fs import split_path

# The working directory inside the e2b sandbox. Paths given to write_file/read_file/cwd follow the local
# convention (relative, or absolute under /workspace) and are mapped here; the default e2b user owns it.
E2B_WORKDIR = "/home/user/workspace"
_E2B_HOME = "/home/user"  # exists in every e2b template; setup commands run there (envd needs a real cwd)
_SANDBOX_LIFETIME_S = 3600  # the provider kills an idle sandbox after this; the pool recycles earlier


def _sdk() -> Any:
    try:
        import e2b  # type: ignore[import-not-found]
    except ImportError:
        raise SandboxUnavailable(
            "sandbox.backend=e2b needs the e2b SDK: pip install 'rayrl[e2b]' (or pip install e2b)"
        ) from None
    return e2b


def _api_key() -> str:
    key = os.environ.get("E2B_API_KEY", "")
    if not key:
        raise SandboxUnavailable(
            "sandbox.backend=e2b needs an API key in the E2B_API_KEY environment variable")
    return key


class E2BSandbox:
    """A cloud sandbox from e2b.dev behind the Sandbox protocol."""

    def __init__(self, config: SandboxConfig, max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
                 _remote: Any = None, _owner: bool = True) -> None:
        self.config = config
        self.max_output_bytes = max_output_bytes
        self._owner = _owner
        self._closed = False
        if _remote is None:
            if config.allowed_hosts:
                raise SandboxUnavailable(
                    "sandbox.allowed_hosts is enforced by the local backend only; with backend=e2b use "
                    "network: true without allowed_hosts (e2b's own egress rules are not mapped)")
            e2b, key = _sdk(), _api_key()
            kwargs: dict[str, Any] = {"api_key": key, "timeout": _SANDBOX_LIFETIME_S,
                                      "allow_internet_access": bool(config.network)}
            if config.image:
                kwargs["template"] = config.image
            try:
                _remote = e2b.Sandbox.create(**kwargs)
            except Exception as err:
                raise SandboxError(f"e2b: could not create a sandbox: {err}") from err
        self._remote = _remote
        if _owner:
            self._run_checked(f"mkdir -p {shlex.quote(E2B_WORKDIR)}")
            self._preload()

    @classmethod
    def attach(cls, handle: SandboxHandle) -> "E2BSandbox":
        """Reconnect to a running e2b sandbox by id (another process created it)."""
        e2b, key = _sdk(), _api_key()
        try:
            remote = e2b.Sandbox.connect(handle.sandbox_id, api_key=key)
        except Exception as err:
            raise SandboxError(f"e2b: could not connect to sandbox {handle.sandbox_id}: {err}") from err
        cap = int(handle.options.get("max_output_bytes", DEFAULT_MAX_OUTPUT_BYTES))
        return cls(handle.config, cap, _remote=remote, _owner=False)

    @property
    def sandbox_id(self) -> str:
        return str(self._remote.sandbox_id)

    def handle(self) -> SandboxHandle:
        return SandboxHandle("e2b", self.sandbox_id, None, self.config,
                             {"max_output_bytes": self.max_output_bytes})

    def set_lease(self, lease_id: str | None) -> None:
        """Leases are not fenced on e2b (no shared file to check); kept for protocol compatibility."""

    def exec(self, cmd: str | list[str], timeout: float | None = None, env: dict[str, str] | None = None,
             cwd: str | None = None) -> ExecResult:
        """Run ``cmd`` through ``commands.run``; a non-zero exit or a timeout is a result, not an error."""
        self._check_open()
        if isinstance(cmd, (list, tuple)):
            if not cmd or not all(isinstance(a, str) for a in cmd):
                raise SandboxError(f"cmd must be a string or a non-empty list of strings, got {cmd!r}")
            line = shlex.join(cmd)
        elif isinstance(cmd, str):
            line = cmd
        else:
            raise SandboxError(f"cmd must be a string or a non-empty list of strings, got {cmd!r}")
        timeout_s = self.config.timeout_s if timeout is None else float(timeout)
        workdir = posixpath.join(E2B_WORKDIR, *split_path(cwd)) if cwd else E2B_WORKDIR
        return self._run(line, timeout_s, workdir, env)

    def _run(self, line: str, timeout_s: float, workdir: str, env: dict[str, str] | None) -> ExecResult:
        envs = {"HOME": E2B_WORKDIR, "LANG": "C.UTF-8", **(env or {})}
        e2b = _sdk()
        exit_exc = getattr(e2b, "CommandExitException", None)
        timeout_exc = getattr(e2b, "TimeoutException", None)
        started = time.monotonic()
        timed_out = False
        try:
            res = self._remote.commands.run(f"/bin/sh -c {shlex.quote(line)}", envs=envs, cwd=workdir,
                                            timeout=timeout_s)
            code, out, err = int(res.exit_code), res.stdout or "", res.stderr or ""
        except Exception as exc:
            if exit_exc is not None and isinstance(exc, exit_exc):
                code, out, err = int(exc.exit_code), exc.stdout or "", exc.stderr or ""
            elif timeout_exc is not None and isinstance(exc, timeout_exc):
                code, out, err, timed_out = 137, "", str(exc), True
            else:
                raise SandboxError(f"e2b sandbox {self.sandbox_id}: exec failed: {exc}") from exc
        return ExecResult(
            exit_code=code,
            stdout=self._cap(out),
            stderr=self._cap(err),
            timed_out=timed_out,
            duration_s=time.monotonic() - started,
        )

    def write_file(self, path: str, data: bytes) -> None:
        self._check_open()
        target = posixpath.join(E2B_WORKDIR, *split_path(path))
        try:
            self._remote.files.write(target, bytes(data))
        except Exception as err:
            raise SandboxError(f"e2b sandbox {self.sandbox_id}: write_file({path!r}) failed: {err}") from err

    def read_file(self, path: str) -> bytes:
        self._check_open()
        target = posixpath.join(E2B_WORKDIR, *split_path(path))
        try:
            return bytes(self._remote.files.read(target, format="bytes"))
        except Exception as err:
            raise SandboxError(f"e2b sandbox {self.sandbox_id}: read_file({path!r}) failed: {err}") from err

    def reset(self) -> None:
        """Fresh working directory. Processes the previous lease left running are killed by recycling."""
        if not self._owner:
            raise SandboxError("reset: only the creator of the sandbox may reset it")
        self._run_checked(f"rm -rf {shlex.quote(E2B_WORKDIR)} && mkdir -p {shlex.quote(E2B_WORKDIR)}")
        self._preload()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owner:
            try:
                self._remote.kill()
            except Exception as err:
                raise SandboxError(f"e2b sandbox {self.sandbox_id}: kill failed: {err}") from err

    def __enter__(self) -> "E2BSandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _cap(self, text: str) -> str:
        data = text.encode("utf-8", errors="replace")
        return truncate_output(data, len(data), self.max_output_bytes)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"e2b sandbox {self.sandbox_id} is closed")

    def _run_checked(self, line: str) -> None:
        """A setup command, run in the home directory (the working directory may not exist yet)."""
        self._check_open()
        result = self._run(line, 60.0, _E2B_HOME, None)
        if not result.ok:
            raise SandboxError(f"e2b sandbox {self.sandbox_id}: {line!r} failed: {result.stderr.strip()}")

    def _preload(self) -> None:
        for path, content in self.config.files.items():
            self.write_file(path, content.encode())
