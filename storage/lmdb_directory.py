"""The files of a disk store's directory besides LMDB's own: the directory's permissions,
the writer lock, the seal key file, moving a store aside or replacing it, directory fsyncs.

:mod:`storage.lmdb_layout` opens a store with them; the admin operations
(:mod:`storage.lmdb_admin`, :mod:`storage.lmdb_repair`) copy, lock and move stores with them.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from storage.base import StoreError
from storage.seal import KEY_FILE_NAME, SealKey, create_key_file, load_key_file

logger = logging.getLogger(__name__)

LOCK_NAME = "writer.lock"
DESCRIPTOR_NAME = "tiered_kv.json"  # storage.lmdb_descriptor's StoreDescriptor


def prepare_directory(path: Path) -> None:
    """Create the store directory (0700) if it is missing; check that we can write it."""
    if path.exists() and not path.is_dir():
        raise StoreError(f"{path} exists and is not a directory")
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise StoreError(f"cannot create the store directory {path}: {e}") from None
        os.chmod(path, 0o700)
    if not os.access(path, os.W_OK | os.X_OK) or os.statvfs(path).f_flag & os.ST_RDONLY:
        raise StoreError(
            f"{path} is not writable (a read-only filesystem, or its permissions); it can "
            "only be opened read-only"
        )


def make_private(path: Path) -> None:
    """Tighten a store directory that others can read to 0700 (a cache holds other users'
    prompts as KV), or warn if it is not ours to change."""
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o077:
        return
    if st.st_uid != os.geteuid():
        logger.warning(
            "%s is accessible to other users (mode %o) and owned by uid %d, not us: "
            "leaving its mode; make it 0700", path, mode, st.st_uid,
        )
        return
    try:
        os.chmod(path, 0o700)
    except OSError as e:
        logger.warning("%s is accessible to other users (mode %o): %s", path, mode, e.strerror)
        return
    logger.info("%s was accessible to other users (mode %o); made it 0700", path, mode)


def lock_writer(path: Path) -> int:
    """Take the store's writer lock; returns the descriptor whose closing releases it."""
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise StoreError(f"cannot open {path / LOCK_NAME}: {e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise StoreError(
                f"{path} is already open for writing (by pid {holder}); only one writer "
                "may open a store; use readonly=True to read it meanwhile"
            ) from None
        raise StoreError(f"cannot lock {path / LOCK_NAME}: {e}") from None
    try:  # the holder, named to the next one refused; the lock is what counts
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    except OSError as e:  # a full disk
        logger.warning("%s: cannot write our pid into it: %s", path / LOCK_NAME, e.strerror)
    return fd


def move_aside(path: Path) -> Path:
    """Rename a (damaged) store directory to ``<dir>.damaged-<UTC time>``; returns the new
    name. The directory is kept whole for ``tiered-kv storage repair``. A mount point (a
    volume mounted at the store directory, as compose does) cannot be renamed: its entries
    move into ``<dir>/<name>.damaged-<UTC time>/`` instead, and the directory stays."""
    aside = _aside_name(path)
    try:
        os.rename(path, aside)
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise StoreError(f"cannot move {path} aside to {aside}: {e}") from None
        return _move_entries(path, _aside_name(path, inside=True))
    _fsync_dir(aside.parent, f"cannot move {path} aside to {aside}")
    return aside


def fresh_place(path: Path) -> Path:
    """Where to build a store that is to replace the one at ``path`` (:func:`replace_aside`):
    beside it, or inside it if it is a mount point, so that its files can move in."""
    name = f"{path.name}.repairing"
    return path / name if os.path.ismount(path) else path.with_name(name)


def replace_aside(path: Path, fresh: Path) -> Path:
    """Put the store directory ``fresh`` (at :func:`fresh_place`) in the place of ``path``,
    and ``path`` aside (as :func:`move_aside`); returns where ``path`` went. Where the
    filesystem can swap two names at once (Linux's ``renameat2`` with ``RENAME_EXCHANGE``)
    there is never a moment without a store at ``path``, so a process killed midway leaves
    one there, never none. Inside a mount point the entries move, ``fresh``'s descriptor
    last: one killed midway leaves a directory refused for want of it, every file kept."""
    if fresh.parent == path:
        aside = _move_entries(path, _aside_name(path, inside=True), keep=fresh.name)
        _move_entries(fresh, path, last=DESCRIPTOR_NAME)
        try:
            fresh.rmdir()
        except OSError as e:
            raise StoreError(f"cannot remove {fresh}: {e}") from None
        return aside
    if _exchange(fresh, path):  # path holds the fresh store now, fresh the old one
        aside = _aside_name(path)
        _rename(fresh, aside, f"cannot move the replaced store {fresh} to {aside}")
        return aside
    moved = _aside_name(path)
    _rename(path, moved, f"cannot move {path} aside to {moved}")
    _rename(fresh, path, f"cannot move {fresh} to {path}")
    return moved


def is_aside(name: str) -> bool:
    """Whether ``name``, an entry of a store directory, is a damaged store moved aside
    into it (:func:`move_aside` of a mount point)."""
    return ".damaged-" in name


def _move_entries(source: Path, dest: Path, *, keep: str = "", last: str = "") -> Path:
    """Move the entries of ``source`` into the directory ``dest`` (created if missing), one
    atomic rename each, ``last`` last; ``keep`` and stores moved aside stay. Returns ``dest``."""
    failure = f"cannot move the files of {source} into {dest}"
    try:
        dest.mkdir(mode=0o700, exist_ok=True)
        names = [n for n in os.listdir(source) if n not in (keep, dest.name) and not is_aside(n)]
        for name in sorted(names, key=lambda n: n == last):
            os.rename(source / name, dest / name)
    except OSError as e:
        raise StoreError(f"{failure}: {e}") from None
    _fsync_dir(dest, failure)
    _fsync_dir(source, failure)
    return dest


def _fsync_dir(path: Path, failure: str) -> None:
    try:
        fsync_dir(path)
    except OSError as e:
        raise StoreError(f"{failure}: {e}") from None


def _rename(source: Path, dest: Path, failure: str) -> None:
    """Rename, durably (the directory is fsynced); :class:`StoreError` saying ``failure``."""
    try:
        os.rename(source, dest)
        fsync_dir(dest.parent)
    except OSError as e:
        raise StoreError(f"{failure}: {e}") from None


def _aside_name(path: Path, *, inside: bool = False) -> Path:
    """A free name ``<dir>.damaged-<UTC time>``, beside ``path`` or inside it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    where = path if inside else path.parent
    aside = where / f"{path.name}.damaged-{stamp}"
    suffix = 1
    while aside.exists():
        suffix += 1
        aside = where / f"{path.name}.damaged-{stamp}-{suffix}"
    return aside


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one step; False where the system or filesystem
    cannot (the caller then renames twice)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a libc without it
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        fsync_dir(a.parent)
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise StoreError(f"cannot swap {a} and {b}: {os.strerror(code)}")


def make_file_private(path: Path) -> None:
    """Owner-only access to a file that LMDB created with the umask's mode (its copies)."""
    os.chmod(path, 0o600)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def store_key(path: Path, *, create: bool) -> SealKey:
    """The key of ``<path>/seal.key``. With ``create`` (a writer, under the writer lock) the
    file is created if missing and a looser mode is tightened to 0600."""
    where = path / KEY_FILE_NAME
    if create:
        try:
            return create_key_file(where)
        except FileExistsError:
            make_key_private(where)
        except OSError as e:
            raise StoreError(f"cannot create the store's key file {where}: {e.strerror or e}") from None
    elif not where.exists():
        raise StoreError(
            f"{path} has no key file ({KEY_FILE_NAME}): it was written before records were "
            f"sealed, or the file was removed; `tiered-kv storage init {path}` creates one "
            "(and drops the records it cannot verify)"
        )
    try:
        return load_key_file(where)
    except ValueError as e:
        raise StoreError(str(e)) from None


def make_key_private(where: Path) -> None:
    """Tighten a key file that others can read to 0600 when it is ours to change."""
    with contextlib.suppress(OSError):
        st = where.stat()
        if stat.S_IMODE(st.st_mode) & 0o077 and st.st_uid == os.geteuid():
            os.chmod(where, 0o600)
            logger.warning("%s was readable by other users; made it 0600", where)


def copy_key_file(source: Path, dest: Path) -> None:
    """Give the store ``dest`` the key of the store ``source`` (a copy of the same store)."""
    data = (source / KEY_FILE_NAME).read_bytes()
    fd = os.open(dest / KEY_FILE_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
