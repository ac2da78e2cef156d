"""Host-side file access to a sandbox's working directory that cannot be tricked into escaping it.

The working directory is writable by sandboxed code, which may plant symlinks (``x -> /root``) or FIFOs
and race them against us. So a path is never resolved by the kernel in one go: it is split into names,
``..`` is refused, and each name is opened relative to its parent's file descriptor with ``O_NOFOLLOW``.
A symlink anywhere on the path is refused, a special file is refused, and nothing blocks.
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil
import stat

from rayrl.sandboxes.base import SandboxError

# The working directory as sandboxed commands see it; absolute paths must live under it.
WORKSPACE = "/workspace"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def split_path(path: str) -> list[str]:
    """``path`` as names relative to the working directory; raises SandboxError for any escape."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxError(f"invalid sandbox path {path!r}")
    rel = path
    if path.startswith("/"):
        if path != WORKSPACE and not path.startswith(WORKSPACE + "/"):
            raise SandboxError(f"path {path!r} is outside the sandbox working directory {WORKSPACE}")
        rel = path[len(WORKSPACE) :]
    norm = posixpath.normpath("./" + rel.lstrip("/"))
    if norm == ".." or norm.startswith("../"):
        raise SandboxError(f"path {path!r} escapes the sandbox working directory")
    return [p for p in norm.split("/") if p not in ("", ".")]


def _open_dir_chain(workdir: str, names: list[str], create: bool, owner: tuple[int, int] | None) -> int:
    """An fd of the directory ``workdir/names...``, each step opened without following symlinks."""
    fd = os.open(workdir, _DIR_FLAGS)
    try:
        for name in names:
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                if owner is not None:
                    os.fchown(nxt, *owner)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise SandboxError(f"refusing {name!r}: a symlink or not a directory") from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_file(workdir: str, path: str, data: bytes, owner: tuple[int, int] | None = None) -> None:
    """Write ``data`` at ``path`` under ``workdir``, creating parents; ``owner`` chowns what we create."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SandboxError(f"write_file({path!r}): data must be bytes, got {type(data).__name__}")
    names = split_path(path)
    if not names:
        raise SandboxError(f"write_file({path!r}): that is the working directory itself")
    try:
        dfd = _open_dir_chain(workdir, names[:-1], create=True, owner=owner)
    except FileNotFoundError as err:
        raise SandboxError(f"write_file({path!r}): {err.strerror}") from None
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(names[-1], flags, 0o644, dir_fd=dfd)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise SandboxError(f"write_file({path!r}): refusing a symlink, FIFO or directory") from None
            raise SandboxError(f"write_file({path!r}): {err.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SandboxError(f"write_file({path!r}): not a regular file")
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if owner is not None:
                os.fchown(fd, *owner)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def read_file(workdir: str, path: str) -> bytes:
    """The bytes of the regular file at ``path`` under ``workdir``."""
    names = split_path(path)
    if not names:
        raise SandboxError(f"read_file({path!r}): that is the working directory itself")
    try:
        dfd = _open_dir_chain(workdir, names[:-1], create=False, owner=None)
    except FileNotFoundError:
        raise FileNotFoundError(f"no such file in the sandbox: {path}") from None
    try:
        try:
            fd = os.open(names[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            raise FileNotFoundError(f"no such file in the sandbox: {path}") from None
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise SandboxError(f"read_file({path!r}): refusing a symlink") from None
            raise SandboxError(f"read_file({path!r}): {err.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SandboxError(f"read_file({path!r}): not a regular file")
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def resolve_cwd(workdir: str, cwd: str | None) -> list[str]:
    """The names of an existing directory under the working directory for an exec's ``cwd``."""
    if cwd is None:
        return []
    names = split_path(cwd)
    try:
        os.close(_open_dir_chain(workdir, names, create=False, owner=None))
    except FileNotFoundError:
        raise SandboxError(f"cwd {cwd!r} does not exist in the sandbox") from None
    return names


def _make_removable(path: str) -> None:
    """Give the owner rwx on every directory under ``path`` (sandboxed code may have chmod-ed them).

    Each directory is opened with O_NOFOLLOW and changed through its fd, so a directory swapped for a
    symlink can never redirect the chmod to a host path.
    """
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                _make_removable(entry.path)


def remove_tree(path: str) -> None:
    """Remove ``path`` even if sandboxed code left directories without write or search permission."""
    if not os.path.lexists(path):
        return
    try:
        shutil.rmtree(path)
    except OSError:
        _make_removable(path)
        shutil.rmtree(path)
