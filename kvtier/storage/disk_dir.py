"""A disk tier's directory: created private, held by one manager at a time, writable or read-only.

What lives in ``<DiskTier.path>/kvtier-<layout fingerprint>/`` (directories 0700, files 0600)::

    lock            locked (``flock``) while a manager holds the directory; names the holder
    secret          random bytes: the key of the index's scope tags (``kvtier.storage.disk_index``)
    index.sqlite    the index, with SQLite's ``-wal`` and ``-shm`` files
    group<g>.pages  one page file per layer group (``kvtier.storage.page_files``)

A directory is in one of three modes, decided once when it is opened:

- writable: the usual;
- read-only: it exists but cannot be written (permissions, a read-only file system, no space for
  a new file): the pages its index names are served, nothing is written;
- unusable: it can be neither created nor read, or its file system has no file locks (Lustre
  mounted without ``-o flock``): the tier stores nothing.

The lock is taken before anything in the directory is read or changed, so a second manager on
the directory raises ``DiskTierBusyError`` having changed nothing. It is released by ``close``,
or by the operating system when the process dies, or when the ``DiskDirectory`` is collected (a
manager dropped without ``close``). A dropped manager whose background work (a disk write, a
read) is still running stays alive until that work ends, holding the directory: a new manager
of the same process waits for it (up to ``ABANDONED_WAIT_S``), but refuses at once a directory
whose manager is still in use (``abandon`` tells them apart).

A directory removed (or moved away, another made in its place) while its manager runs is noticed
before the next write (``gone``): the tier then writes nothing more (``Tier.still_writable``).

The lock belongs to the process that took it, not to its forked children (a DataLoader worker, a
multiprocessing pool): a child closes its copies of the lock's descriptor as it starts, without
unlocking them, and ``close`` unlocks before it closes. So the lock is released when its holder
closes the manager or dies, whether or not children it forked still run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import DiskTierBusyError

log = logging.getLogger(__name__)

LOCK_FILE = "lock"
SECRET_FILE = "secret"
SECRET_BYTES = 32
PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700
ABANDONED_WAIT_S = 30.0  # how long a new manager waits for a dropped one's background work to end

_HELD: weakref.WeakValueDictionary[str, DiskDirectory] = weakref.WeakValueDictionary()  # this process's, by real path
_LOCK_FDS: set[int] = set()  # the descriptors of the locks this process holds


def check_disk_path(path: Path, what: str = "DiskTier path") -> None:
    """``ValueError`` when ``path`` or one of its parents is a regular file: no directory can be made
    there (``what``: the argument, as the message names it)."""
    for p in (path, *path.parents):
        try:
            if not p.exists():
                continue
        except OSError:  # cannot look: the directory code reports what it finds
            return
        if not p.is_dir():
            raise ValueError(
                f"{what} {path} cannot be a directory: {p} is a file; give a directory (it is created when missing)"
            )
        return


class DiskDirectory:
    """One disk tier directory, locked for this manager. ``close`` releases it (idempotent)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writable = False
        self.readable = False
        self.why_not_writable = ""
        self.had_pages = False  # page files were there before: a lost index then means lost pages
        self.abandoned = False  # its manager was dropped without close(): only background work holds it
        self.secret: bytes | None = None
        self._finalizer: weakref.finalize | None = None
        self._identity: tuple[int, int] | None = None  # (device, inode) of the directory this manager opened
        self._where = ""  # its absolute path when opened
        check_disk_path(path)
        try:
            _make_private_dirs(path)
        except OSError as exc:
            log.error("kvtier disk tier: cannot create %s (%s); the disk tier stores nothing", path, exc)
            self.why_not_writable = str(exc)
            return
        cannot_lock = self._lock()
        if cannot_lock:
            log.error(
                "kvtier disk tier: cannot lock %s (%s): its file system does not support file locks (Lustre "
                "mounted without -o flock, NFS without lockd), which the disk tier and its index need; the "
                "disk tier stores nothing (give it a directory on a local disk)",
                path,
                cannot_lock,
            )
            self.why_not_writable = f"no file locks: {cannot_lock}"
            return
        try:
            self.had_pages = any(path.glob("group*.pages"))
            self.why_not_writable = _why_not_writable(path)
            self.writable = not self.why_not_writable
            if self.writable:
                make_private(path, PRIVATE_DIR)
            self.secret = self._load_secret()
            st = os.stat(path)
            self._identity = (st.st_dev, st.st_ino)
            self._where = os.path.abspath(path)  # a relative path stays this one after a chdir
        except OSError as exc:  # reading it, or writing the secret of a new directory (a full file system)
            log.error("kvtier disk tier: cannot use %s (%s); the disk tier stores nothing", path, exc)
            self.writable, self.why_not_writable = False, str(exc)
            self.close()
            return
        self.readable = True

    def file(self, name: str) -> Path:
        return self.path / name

    def _lock(self) -> OSError | None:
        """Take the directory's lock, or raise ``DiskTierBusyError`` naming its holder. Returns the
        error of a file system that refuses locks (the directory is then left alone), else None."""
        path = self.path / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
        except OSError:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None  # a read-only directory that never had a lock file: nothing here will be written
        try:
            locked = _try_lock(fd)
        except OSError as refused:  # ENOLCK, ENOSYS, EOPNOTSUPP: no locks on this file system
            os.close(fd)
            return refused
        if not locked:
            holder = _read_holder(fd)
            mine = holder.startswith(f"pid {os.getpid()} ")
            if not (mine and self._released_by_abandoned(fd)):
                os.close(fd)
                who = "another KVCacheManager of this process, still open" if mine else "another KVCacheManager"
                raise DiskTierBusyError(
                    f"the disk tier directory {self.path} is in use by {who} ({holder or 'unknown'}); a directory "
                    "belongs to one manager at a time: close that manager (one replaced without close(), as a "
                    "notebook cell run again replaces it, holds its directory until it is collected), give this "
                    "one another DiskTier path, or share prefixes between processes with a connector"
                )
        # released in this order: whoever takes the file's lock next finds the directory's free
        fds = (*self._lock_directory(fd), fd)
        _LOCK_FDS.update(fds)
        self._finalizer = weakref.finalize(self, _release, fds, os.getpid())
        self._finalizer.atexit = False  # the process's end releases it, after managers closed at exit
        _HELD[_key(self.path)] = self
        _write_holder(fd)
        return None

    def _lock_directory(self, file_fd: int) -> tuple[int, ...]:
        """Lock the directory itself too, beside its lock file (whose lock, taken first, already tells
        an older kvtier): a lock file removed under a live holder (a cleaner of old files in /tmp)
        lets a second manager create and lock a new one, but never the directory, which is not
        removed while it holds files. Returns the directory's locked descriptor (none where the
        directory cannot be opened or locked: the lock file's lock stands alone); raises
        ``DiskTierBusyError``, with the file's lock released, while another holds it."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return ()
        try:
            locked = _try_lock(fd)
        except OSError:
            os.close(fd)
            return ()
        if locked:
            return (fd,)
        os.close(fd)
        _release((file_fd,), os.getpid())
        raise DiskTierBusyError(
            f"the disk tier directory {self.path} is in use by another KVCacheManager (its lock file was removed "
            "under it, so the holder is not named there): a directory belongs to one manager at a time"
        )

    def _released_by_abandoned(self, fd: int) -> bool:
        """Whether the lock, held in this process, could be taken once a manager dropped without
        close() was collected; waits while its background work still holds it (``abandoned``)."""
        deadline = time.monotonic() + ABANDONED_WAIT_S
        while True:
            gc.collect()  # a dropped manager releases the lock when it is collected
            if _try_lock(fd):
                return True
            holder = _HELD.get(_key(self.path))  # None: collected just now (its work ended), try again
            in_use = holder is not None and not holder.abandoned
            del holder  # not kept alive by this wait
            if in_use or time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def gone(self) -> bool:
        """Whether ``path`` no longer names the directory this manager opened: it was removed (``rm -rf``),
        perhaps another made in its place, or moved away. What is
        written to its files from then on is lost at the manager's end (removed: they are unlinked)."""
        if self._identity is None:
            return False
        try:
            st = os.stat(self._where)
        except FileNotFoundError:
            return True
        except OSError:  # cannot look (a transient error): taken as still there
            return False
        return (st.st_dev, st.st_ino) != self._identity

    def abandon(self) -> None:
        """Its manager was dropped without close(): a new manager may wait for its release."""
        self.abandoned = True

    def _load_secret(self) -> bytes | None:
        """The directory's secret; a new one when there is none (the index then no longer matches)."""
        path = self.path / SECRET_FILE
        try:
            data = path.read_bytes()
            if len(data) == SECRET_BYTES:
                return data
        except OSError:
            pass
        if not self.writable:
            return None
        secret = os.urandom(SECRET_BYTES)  # written before the index that depends on it
        staged = self.path / f"{SECRET_FILE}.new"
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE)
        try:
            try:
                if os.write(fd, secret) != SECRET_BYTES:
                    raise OSError(errno.ENOSPC, "the secret was written short")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(staged, path)
        except BaseException:
            with contextlib.suppress(OSError):
                staged.unlink()  # (a full file system: nothing half made is left behind)
            raise
        return secret

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()


@dataclass(frozen=True, slots=True)
class OtherDirectory:
    """Another model's or layout's disk tier directory under the same ``DiskTier.path``."""

    name: str
    bytes_used: int  # allocated on disk (page files are sparse: what was written)
    last_used: float  # the newest change to any of its files (seconds since the epoch)


def other_directories(path: Path) -> list[OtherDirectory]:
    """The ``kvtier-*`` directories beside ``path`` (a disk tier's own), oldest use first; those that
    cannot be read are left out, and none is listed when ``path``'s parent cannot be listed."""
    out = []
    try:
        candidates = sorted(path.parent.glob("kvtier-*"))
    except OSError:  # a parent this user may not enter, a name too long: nothing to weigh
        return []
    for other in candidates:
        try:
            if other == path or not other.is_dir():
                continue
            stats = [f.stat() for f in other.iterdir() if f.is_file()]
        except OSError:
            continue
        used = sum(st.st_blocks * 512 for st in stats)
        out.append(OtherDirectory(other.name, used, max((st.st_mtime for st in stats), default=0.0)))
    return sorted(out, key=lambda d: d.last_used)


def _key(path: Path) -> str:
    """The path of a directory as every spelling of it resolves."""
    return os.path.realpath(path)


def open_private(path: Path, flags: int) -> int:
    """``os.open`` that creates a file 0600 and narrows an existing file of this user to 0600."""
    fd = os.open(path, flags | os.O_CLOEXEC, PRIVATE_FILE)
    if flags & (os.O_RDWR | os.O_WRONLY):
        try:
            st = os.fstat(fd)
            if st.st_mode & 0o077 and st.st_uid == os.geteuid():
                os.fchmod(fd, PRIVATE_FILE)
        except OSError:
            pass
    return fd


def _make_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parent 0700 (``mkdir -p`` would make the parents world-readable)."""
    missing = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, PRIVATE_DIR)


def make_private(path: Path, mode: int = PRIVATE_FILE) -> None:
    """Narrow ``path`` (this user's) to ``mode``, e.g. a file written before kvtier created them private."""
    try:
        st = path.stat()
        if st.st_mode & 0o777 & ~mode and st.st_uid == os.geteuid():
            path.chmod(mode)
    except OSError:
        pass


def _why_not_writable(path: Path) -> str:
    """Empty when files can be created in ``path`` and its existing files written; else the reason."""
    probe = path / f".probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE))
        probe.unlink()
        for name in ("index.sqlite", "index.sqlite-wal", SECRET_FILE, *(p.name for p in path.glob("group*.pages"))):
            try:
                os.close(os.open(path / name, os.O_RDWR | os.O_CLOEXEC))
            except FileNotFoundError:
                continue
    except OSError as exc:
        return f"{exc.strerror or exc}: {exc.filename}"
    return ""


def _try_lock(fd: int) -> bool:
    """Whether the exclusive lock was taken (False: another holds it); ``OSError`` when the file
    system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _release(fds: tuple[int, ...], pid: int) -> None:
    """Unlock and close the lock descriptors ``fds`` that process ``pid`` took. Unlocking releases
    a lock even while a forked child still has a copy of the descriptor. In a forked child (another
    pid) nothing is done: the child closed its copies as it started, and ``fds`` may now be other files."""
    if os.getpid() != pid:
        return
    for fd in fds:
        _LOCK_FDS.discard(fd)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _close_inherited_locks() -> None:
    """In a forked child: close the copies of the parent's lock descriptors, never unlocking them
    (``LOCK_UN`` on a copy would release the parent's lock): the lock then lives only as long as the
    parent holds it."""
    for fd in _LOCK_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _write_holder(fd: int) -> None:
    """Name this process in the lock file, for the error a second manager raises."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n".encode(), 0)
    except OSError:  # a read-only lock file: the holder stays unnamed
        pass
