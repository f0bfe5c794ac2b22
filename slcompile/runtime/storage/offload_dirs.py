"""The private directories nvme arenas live in: made, locked, found stale, removed.

Where it sits: below the nvme arena (``slcompile.runtime.storage.nvme``), which makes its
directory here, lists it as live and removes it when it is closed or collected.

Guarantees (the privacy, liveness and cleanup the arena promises):
- ``make_private_dir`` makes ``<offload_dir>/slc-offload-<pid>-<random>`` with mode
  0700 under a temporary name, opens it without following links, refuses one that
  is not this user's, takes the exclusive ``flock`` of its ``lock`` file and only
  then gives it its final name.
- ``clean_stale_dirs`` removes only directories named like ours, owned by this
  user, whose lock can be taken; pids are never consulted.
- ``LIVE_DIRS`` lists this process's directories; they are removed on SIGTERM when
  SIGTERM had its default action (``install_sigterm_cleanup``), and by
  ``remove_private_dir`` only in the process that made them.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import threading
import time

from ..errors import OffloadDirError, OffloadError

__all__ = [
    "PRIVATE_DIR_PREFIX",
    "LIVE_DIRS",
    "clean_stale_dirs",
    "make_private_dir",
    "warn_if_others_can_move",
    "install_sigterm_cleanup",
    "remove_private_dir",
]

log = logging.getLogger(__name__)

PRIVATE_DIR_PREFIX = "slc-offload-"
_PRIVATE_DIR_PATTERN = re.compile(r"^slc-offload-(\d+)-[0-9a-f]{8}$")
# A private directory is made under this name and renamed to its final one once
# its lock is held, so that no cleaner ever sees a live directory unlocked.
_UNFINISHED_PATTERN = re.compile(r"^slc-offload-(\d+)-[0-9a-f]{8}\.new$")
_UNFINISHED_GRACE_SECONDS = 600.0
_LOCK_FILE = "lock"


# This process's live private directories, path -> the pid that made them. Read by
# the SIGTERM handler, so a plain dict (no lock a handler could wait on).
LIVE_DIRS: dict[str, int] = {}
_SIGTERM = {"installed": False}


def _try_lock(dir_fd: int) -> int | None:
    """The descriptor of a directory's lock file, locked; None if another process
    holds the lock or there is no lock file."""
    try:
        fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def clean_stale_dirs(base: str) -> list[str]:
    """Removes private arena directories under ``base`` whose arena is gone.

    A directory is removed only if it is named like ours, owned by this user, and
    its lock file's lock can be taken: the process that held it died (or closed
    the arena without removing it). Pids are not consulted: a pid names a process
    only in its own pid namespace and on its own host. A directory without a lock
    file is kept, as is one of this process's own live arenas.

    Args:
        base: The parent directory (an ``offload_dir``).

    Returns:
        The paths removed.
    """
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        unfinished = _UNFINISHED_PATTERN.match(name)
        if _PRIVATE_DIR_PATTERN.match(name) is None and unfinished is None:
            continue
        path = os.path.join(base, name)
        if path in LIVE_DIRS:
            continue
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        lock_fd = None
        try:
            info = os.fstat(dir_fd)
            if info.st_uid != os.getuid():
                continue
            # An unfinished directory is locked only a moment after it is made:
            # left alone while it may still be on its way.
            if unfinished is not None and time.time() - info.st_mtime < _UNFINISHED_GRACE_SECONDS:
                continue
            lock_fd = _try_lock(dir_fd)
            if lock_fd is None:
                continue
            # Removed while holding the lock: a second cleaner finds it taken.
            shutil.rmtree(path, ignore_errors=True)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
            os.close(dir_fd)
        log.info("removed offload directory %s left by a process that is gone", path)
        removed.append(path)
    return removed


def make_private_dir(base: str) -> tuple[str, int, int]:
    """Creates this arena's private directory under ``base``, locked.

    Returns:
        Its path, a descriptor of it and the descriptor of its locked lock file.
    """
    if not os.path.exists(base):
        parent = os.path.dirname(base)
        if not os.path.isdir(parent):
            raise OffloadDirError(f"offload directory does not exist, nor does its parent {parent}", path=base)
        try:
            os.mkdir(base, 0o700)  # only the last folder, private like the arena's own
        except FileExistsError:
            pass
        except OSError as error:
            raise OffloadDirError(
                f"cannot create the offload directory in {parent}: {_why_not_writable(error)}", path=base
            ) from error
    if not os.path.isdir(base):
        raise OffloadDirError("offload directory is not a directory", path=base)
    for _ in range(8):
        path = os.path.join(base, f"{PRIVATE_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        unfinished = path + ".new"
        try:
            os.mkdir(unfinished, 0o700)
        except FileExistsError:
            continue
        except OSError as error:
            raise OffloadDirError(
                f"cannot create a private directory in the offload directory: {_why_not_writable(error)}",
                path=base,
            ) from error
        dir_fd, lock_fd = _open_private_dir(unfinished)
        try:
            if os.path.lexists(path):
                raise FileExistsError(path)
            os.rename(unfinished, path)
            if os.lstat(path).st_ino != os.fstat(dir_fd).st_ino:
                raise OffloadDirError("the private directory was replaced while it was being made", path=path)
        except FileExistsError:
            shutil.rmtree(unfinished, ignore_errors=True)
            os.close(lock_fd)
            os.close(dir_fd)
            continue
        except OffloadError:
            os.close(lock_fd)  # a directory swapped in is not ours to remove
            os.close(dir_fd)
            raise
        except OSError as error:
            shutil.rmtree(unfinished, ignore_errors=True)
            os.close(lock_fd)
            os.close(dir_fd)
            raise OffloadDirError(f"cannot name the private directory ({error.strerror})", path=path) from error
        return path, dir_fd, lock_fd
    raise OffloadDirError("could not find a free private directory name", path=base)


def _open_private_dir(path: str) -> tuple[int, int]:
    """Opens a just-made private directory without following links, checks it is
    this user's (a directory swapped in by a race is refused, not chmod-ed) and
    takes its lock. Returns the directory's descriptor and the lock file's."""
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise OffloadDirError(
            f"cannot open the private directory just made ({error.strerror}): it was replaced, "
            "perhaps by a link", path=path,
        ) from error
    try:
        info = os.fstat(dir_fd)
        if info.st_uid != os.getuid():
            raise OffloadDirError(
                f"the private directory just made belongs to uid {info.st_uid}, not to this user "
                f"({os.getuid()}): it was replaced by someone else; refusing to use it", path=path,
            )
        if stat.S_IMODE(info.st_mode) & 0o077:
            os.fchmod(dir_fd, 0o700)  # this user's own, made wider by a umask or an ACL default
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        lock_fd = os.open(_LOCK_FILE, flags, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            raise
    except OffloadError:
        os.close(dir_fd)
        raise
    except OSError as error:
        os.close(dir_fd)
        shutil.rmtree(path, ignore_errors=True)
        raise OffloadDirError(f"cannot lock the private directory ({error.strerror})", path=path) from error
    return dir_fd, lock_fd


def install_sigterm_cleanup() -> None:
    """On SIGTERM with its default action, removes this process's private
    directories, then dies by the signal as it would have. A handler someone else
    installed is left in charge (it may shut down gracefully and still read the
    arena); interpreter exit removes the directories then. Only the main thread may
    install handlers: from another thread this does nothing."""
    if _SIGTERM["installed"] or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter
        return
    _SIGTERM["installed"] = True


def _on_sigterm(signum, frame) -> None:
    _remove_live_dirs()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _remove_live_dirs() -> None:
    """Removes the private directories this process made; without waiting for I/O
    (a signal handler may run while an I/O thread waits for this thread)."""
    pid = os.getpid()
    for path, owner in list(LIVE_DIRS.items()):
        if owner == pid:
            shutil.rmtree(path, ignore_errors=True)


def warn_if_others_can_move(path: str) -> None:
    """Warns when another user could move the private directory made in ``path``
    away (and put their own in its place): ``path`` or a folder above it is writable
    by every user without the sticky bit, which would keep others from renaming what
    is not theirs (as /tmp's does). The arena's own descriptors keep working; the
    cleanup, which goes by path, would then miss the directory."""
    folder = path
    while True:
        try:
            mode = os.stat(folder).st_mode
        except OSError:
            return
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            log.warning(
                "offload directory %s: %s is writable by every user and has no sticky bit (mode %04o), so "
                "another user can move the private directory made there away; use a directory only you can "
                "write to, or set the sticky bit (chmod +t %s)", path, folder, stat.S_IMODE(mode), folder)
            return
        parent = os.path.dirname(folder)
        if parent == folder:
            return
        folder = parent


def _why_not_writable(error: OSError) -> str:
    """The cause of a failed mkdir in an existing directory, in words: ENOENT there
    means a filesystem that takes no new entries (/proc, /sys), not a missing path."""
    if error.errno in (errno.EACCES, errno.EPERM):
        return "this user may not write there (permission denied)"
    if error.errno == errno.EROFS:
        return "the filesystem is read-only"
    if error.errno == errno.ENOENT:
        return "the filesystem takes no new files or folders (a virtual one such as /proc or /sys)"
    return error.strerror or str(error)


def remove_private_dir(
    executors: tuple, fds: list[int], path: str, owner: int
) -> None:
    # Runs from close(), garbage collection or interpreter exit; must not use the arena.
    # A forked child inherits the arena but not the directory: only its maker removes it.
    # `executors` (the I/O threads) finish what was queued first.
    mine = os.getpid() == owner
    if mine:
        for executor in executors:
            executor.shutdown()
        shutil.rmtree(path, ignore_errors=True)
        LIVE_DIRS.pop(path, None)
    # The lock file's descriptor is the last of `fds`: closed after the removal.
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
