"""Where the compiled library of ``core/native.py`` lies, and how it is built and opened so that nobody else's code
and no damaged file is ever loaded.  ``core/backend.py`` keeps its compiled CUDA modules the same way
(:func:`read_blob` / :func:`write_blob` in a directory opened by :func:`open_private_dir`).

A cache directory is used only through a descriptor: it is opened with ``O_DIRECTORY | O_NOFOLLOW`` at the end of a
walk that opens each directory of its real path the same way, and refused (with the reason) when the descriptor is
not this user's or is writable by group or others, when a directory above it is writable by others without the
sticky bit or belongs to another user (not root), or when a symbolic link on the way belongs to another user.
Everything after that (the lock, the build, the rename, the check, the load) is relative to that descriptor, so
swapping a path afterwards changes nothing.

A library's name holds the sha256 of its bytes: ``elementwise-<key>-<sha256>.so``.  Before one is loaded, it is
opened without following links, checked (a regular file of this user, not writable by others), read whole through
that descriptor and hashed; only that same open file is then mapped (``dlopen("/proc/self/fd/N")``), so a truncated,
empty, garbage or swapped file is never mapped (a truncated ELF, once mapped, kills the process with SIGBUS).  A
file that fails the check is removed and the library is built again.  The build runs under ``flock`` on ``.lock`` in the directory,
so processes starting together compile once (a holder stuck for :data:`STALE_S` is given up on: the twins run).  It
writes a temporary ``tmp<hex>.so``, fsyncs it, renames it into place and fsyncs the directory, so a power loss leaves
either no library or a whole one.  Temporaries left by a killed build (ours, matching that pattern, older than
:data:`STALE_S`) are removed under the lock.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

COMPILE_TIMEOUT_S = 300
STALE_S = 2 * COMPILE_TIMEOUT_S  # a temporary this old cannot belong to a build still running
_TMP = re.compile(r"tmp[0-9a-z_]{8,32}\.so")  # ours (tmp + 16 hex) and the 8-character mkstemp names of before
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
# (device, inode) of each library loaded -> (its descriptor, the handle).  The descriptor stays open: the name
# "/proc/self/fd/N" that dlopen remembers must never name another library later, and the inode is not re-used.
_loaded: dict[tuple[int, int], tuple[int, Any]] = {}


class Unsafe(Exception):
    """A cache directory that is refused; the message says why."""


def _uid() -> int:
    return os.getuid()


def default_dirs() -> Iterator[tuple[Path, bool]]:
    """(directory, temporary) in the order tried: FLATOPT_CACHE_DIR alone, else the user cache, then a fresh private
    temporary directory (``mkdtemp``: a name nobody can take first), removed again once the library is loaded."""
    env = os.environ.get("FLATOPT_CACHE_DIR")
    if env:
        yield Path(env), False
        return
    xdg = os.environ.get("XDG_CACHE_HOME")
    try:
        yield (Path(xdg) if xdg else Path.home() / ".cache") / "flatopt", False
    except (RuntimeError, KeyError):  # no home directory (a bare service account): the temporary one alone
        pass
    yield Path(tempfile.mkdtemp(prefix="flatopt-")), True


def open_private_dir(d: Path) -> int:
    """A descriptor of ``d`` (made with mode 0700 if missing) after the checks of the module doc; ``Unsafe`` if
    refused."""
    d = Path(os.path.abspath(d))
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    uid = _uid()
    _check_links(d, uid)
    real = os.path.realpath(d)
    fd = os.open("/", _DIR_FLAGS)
    try:
        where = "/"
        for part in Path(real).parts[1:]:
            _check_ancestor(fd, where, uid)
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)  # a component swapped for a link since realpath: ELOOP
            os.close(fd)
            fd, where = nxt, os.path.join(where, part)
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise Unsafe(f"{d} belongs to another user (uid {st.st_uid})")
        if st.st_mode & 0o022:
            raise Unsafe(f"{d} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_ancestor(fd: int, where: str, uid: int) -> None:
    st = os.fstat(fd)
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise Unsafe(f"{where} is writable by others without the sticky bit: anyone can swap the cache directory")
    if st.st_uid not in (0, uid):
        raise Unsafe(f"{where} belongs to another user (uid {st.st_uid}), who can swap the cache directory")


def _check_links(d: Path, uid: int) -> None:
    for p in [*reversed(d.parents), d]:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, uid):
            raise Unsafe(f"{p} is a symbolic link of another user (uid {st.st_uid})")


def load(dfd: int, key: str, compile_to: Callable[[str, tuple[int, ...]], str | None]) -> tuple[Any, str]:
    """(the loaded library, its name) from the directory ``dfd``, built there first (under the lock) when no
    intact one is there; ``compile_to(path, pass_fds)`` builds at ``path`` and returns None, or why it failed
    (then ``RuntimeError``)."""
    lock = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        _take(lock)
        _remove_stale(dfd)
        found = _find(dfd, key)
        if found is None:
            _build(dfd, key, compile_to)
            found = _find(dfd, key)
            if found is None:  # pragma: no cover - what was just built and renamed is checked like any other
                raise RuntimeError(f"the library built for {key} failed its own check")
        fd, name = found
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in _loaded:  # loaded before (native.reset): the same file, the same handle
            os.close(fd)
            return _loaded[st.st_dev, st.st_ino][1], name
        try:
            handle = ctypes.CDLL(f"/proc/self/fd/{fd}")
        except BaseException:
            os.close(fd)
            raise
        _loaded[st.st_dev, st.st_ino] = fd, handle
        return handle, name
    finally:
        os.close(lock)  # (closing releases the lock)


def _take(lock: int) -> None:
    """flock ``lock``, waiting at most STALE_S (a holder that long is stuck, not building): ``TimeoutError``."""
    deadline = time.monotonic() + STALE_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"another process has held the build lock for {STALE_S} s") from None
            time.sleep(0.05)


def _find(dfd: int, key: str) -> tuple[int, str] | None:
    """(an open descriptor, the name) of an intact library for ``key``; any other file under that key's names is
    removed (a truncated, empty, garbage or swapped one)."""
    pattern = re.compile(rf"elementwise-{re.escape(key)}-([0-9a-f]{{64}})\.so")
    for name in sorted(os.listdir(dfd)):
        m = pattern.fullmatch(name)
        if m is None:
            continue
        fd = _open_intact(dfd, name, m.group(1))
        if fd is not None:
            return fd, name
        _unlink(dfd, name)
    return None


def _open_intact(dfd: int, name: str, digest: str) -> int | None:
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
    except OSError:
        return None
    st = os.fstat(fd)
    if (stat.S_ISREG(st.st_mode) and st.st_uid == _uid() and not st.st_mode & 0o022 and st.st_size > 0
            and _sha256(fd) == digest):
        return fd
    os.close(fd)
    return None


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


def _build(dfd: int, key: str, compile_to: Callable[[str, tuple[int, ...]], str | None]) -> None:
    tmp = f"tmp{secrets.token_hex(8)}.so"
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd))
    try:
        failed = compile_to(f"/proc/self/fd/{dfd}/{tmp}", (dfd,))
        if failed:
            raise RuntimeError(failed)
        fd = os.open(tmp, _FILE_FLAGS, dir_fd=dfd)
        try:
            os.fchmod(fd, 0o500)  # the linker made it with the umask's mode
            os.fsync(fd)
            digest = _sha256(fd)
        finally:
            os.close(fd)
        os.rename(tmp, f"elementwise-{key}-{digest}.so", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
    finally:
        _unlink(dfd, tmp)


def _remove_stale(dfd: int) -> None:
    """Remove the temporaries of builds killed before their rename (held under the lock)."""
    now, uid = time.time(), _uid()
    for name in os.listdir(dfd):
        if _TMP.fullmatch(name):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == uid and now - st.st_mtime > STALE_S:
                _unlink(dfd, name)


def _unlink(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise


def remove_temporary(d: Path) -> None:
    """Remove a fallback directory made by ``default_dirs`` (the loaded library stays mapped)."""
    shutil.rmtree(d, ignore_errors=True)


def read_blob(dfd: int, name: str) -> bytes | None:
    """The bytes of ``name`` in the directory ``dfd`` when it is a regular file of this user that others cannot
    write (opened without following links), else None."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != _uid() or st.st_mode & 0o022:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def write_blob(dfd: int, name: str, data: bytes) -> None:
    """Write ``name`` in the directory ``dfd`` atomically: a private temporary, fsynced, renamed into place."""
    tmp = f"tmp{secrets.token_hex(8)}.blob"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
    finally:
        _unlink(dfd, tmp)
