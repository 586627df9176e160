"""The disk tier's directory: its layout, and opening it.

Layout (created 0700)::

    <dir>/tiered_kv.json   descriptor: format name, store version, capacity, map size...
    <dir>/seal.key         the secret that seals this store's records (0600; storage.seal)
    <dir>/writer.lock      flock()ed by the one process that may write
    <dir>/data.mdb         LMDB data file (a sparse map reserved up front)
    <dir>/lock.mdb         LMDB reader table, shared by the writer and read-only admin tools

:func:`open_for_writing` and :func:`open_for_reading` check the directory and, with
:mod:`storage.lmdb_file`, ``data.mdb`` before LMDB maps it, then open the environment with
every option set on purpose. The descriptor is :mod:`storage.lmdb_descriptor`; the
directory's other files (permissions, the writer lock, the key file) are handled by
:mod:`storage.lmdb_directory`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import lmdb

from storage.base import StoreError
from storage.lmdb_descriptor import (
    DESCRIPTOR_TMP_NAME, FORMAT_NAME, STORE_VERSION, StoreDescriptor, default_map_size,
)
from storage.lmdb_file import DATA_NAME, DamagedStore, check_data_file, check_structure
from storage.lmdb_meta import META, pack_meta, unpack_meta
from storage.lmdb_pages import Leak
from storage.priority_lru import DEFAULT_PRIORITY
from storage.record import FORMAT_VERSION as RECORD_FORMAT_VERSION
from storage.record import stated_parent_hash
from storage.lmdb_directory import (
    DESCRIPTOR_NAME, LOCK_NAME, fsync_dir, is_aside, lock_writer, make_private,
    prepare_directory, store_key,
)
from storage.seal import KEY_FILE_NAME, SealKey

logger = logging.getLogger(__name__)

LMDB_LOCK_NAME = "lock.mdb"  # LMDB's reader table (writer.lock is ours)
# Left by a read that met a damaged page: the next writable open checks every page first.
DAMAGE_MARK_NAME = "damage_seen"
# What a directory may hold and still count as empty: leftovers of a creation cut short
# (and damaged stores moved aside into it: lmdb_directory.is_aside).
_CREATION_LEFTOVERS = frozenset({LOCK_NAME, DESCRIPTOR_TMP_NAME, KEY_FILE_NAME})

DB_RECORDS = b"records"
DB_META = b"meta"
DB_QUARANTINE = b"quarantine"
DB_INFO = b"info"
DB_NAMES = (DB_RECORDS, DB_META, DB_QUARANTINE, DB_INFO)

DEFAULT_MAX_READERS = 256
KEYS_CHUNK = 1024  # keys listed per read transaction: short ones keep old pages reusable
U64 = struct.Struct("<Q")
INFO_BYTES_USED = b"bytes_used"
# LMDB errors that mean the file itself is bad, as opposed to a limit or a busy resource.
DAMAGE_ERRORS = (
    lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
    lmdb.PanicError,
)


def mark_damage_seen(path: Path) -> None:
    """Leave :data:`DAMAGE_MARK_NAME` in the store's directory (best effort)."""
    try:
        (path / DAMAGE_MARK_NAME).touch(mode=0o600)
        fsync_dir(path)
    except OSError as e:
        logger.warning("%s: cannot mark the store for a check at its next start: %s", path, e)


def has_data(path: Path) -> bool:
    """Whether a writer has created the store's databases in ``data.mdb``. A creation cut
    short (by a full disk, or a kill) can leave the file missing, empty or without them:
    only a writer completes it. A damaged file counts as created: opening it says so."""
    try:
        meta = check_data_file(path)
    except StoreError:
        return True
    return meta is not None and meta.main.entries > 0


def check_is_store(path: Path) -> None:
    """:class:`StoreError` unless ``path`` holds a store of ours or nothing at all."""
    if (path / DESCRIPTOR_NAME).exists():
        StoreDescriptor.load(path)
        return
    try:
        others = {n for n in os.listdir(path) if n not in _CREATION_LEFTOVERS and not is_aside(n)}
    except OSError as e:
        raise StoreError(f"cannot list {path}: {e}") from None
    if others:
        raise StoreError(
            f"{path} is not empty and has no {DESCRIPTOR_NAME}: not a tiered-kv disk store; "
            "refusing to use it"
        )


def open_env(
    path: Path, *, readonly: bool, sync: bool, map_size: int, max_readers: int
) -> lmdb.Environment:
    """The store's LMDB environment, every option set on purpose."""
    reserve_reader_table(path, max_readers)
    try:
        return lmdb.open(
            str(path),
            subdir=True,  # data.mdb and lock.mdb live in the store directory
            readonly=readonly,  # admin readers map the file read-only, never write
            create=False,  # we create the directory ourselves: 0700, descriptor first
            mode=0o700,  # LMDB drops the x bits: data and lock files are 0600
            map_size=map_size,  # sparse, reserved once; a full map evicts, never resizes
            max_dbs=len(DB_NAMES),  # records, meta, quarantine, info
            sync=sync,  # fsync each commit; with False, flush()/close() fsync
            metasync=sync,  # the meta page makes a commit durable: sync it too
            map_async=False,  # only meaningful with writemap, which we do not use
            writemap=False,  # read-only map: no stray writes, ENOSPC instead of SIGBUS
            readahead=True,  # records are 0.25-2 MiB runs of pages, always read whole
            meminit=True,  # never write stale heap bytes into page slack on disk
            max_readers=max_readers,  # concurrent read txns of the server and admin tools
            max_spare_txns=1,  # reuse one reset read txn instead of a reader-table scan
            lock=True,  # a writer process and read-only admin processes share the env
            # lib_version stays unset: an existing file picks its own engine, and
            # py-lmdb releases before 3.0 do not know the argument.
        )
    except lmdb.MemoryError as e:  # the address space has no room for the map
        raise StoreError(
            f"{path}: cannot reserve a map of {map_size / (1 << 30):,.1f} GiB for the store "
            f"({e}); give it a smaller budget"
        ) from None
    except lmdb.Error as e:
        raise StoreError(f"{path}: cannot open the LMDB environment: {e}") from None


def reserve_reader_table(path: Path, max_readers: int) -> None:
    """Give every page of ``lock.mdb`` its disk blocks before LMDB maps and writes it: on a
    full disk, a write to a mapped page with no block behind it kills the process (SIGBUS).
    An existing file keeps its size (a process may have it mapped); a new one gets the size
    LMDB would give it, 64 bytes a reader plus 128. If it cannot be opened for writing (a
    read-only filesystem, its permissions), LMDB's own open says what is wrong."""
    where = path / LMDB_LOCK_NAME
    if not hasattr(os, "posix_fallocate"):  # macOS
        return
    try:
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size or 64 * max_readers + 128)
    except OSError as e:
        raise StoreError(f"{where}: cannot allocate LMDB's reader table: {e.strerror}") from None
    finally:
        os.close(fd)


class Opened(NamedTuple):
    """An open store: its descriptor, environment and databases, the writer lock's
    descriptor (``None`` for a reader; closing it releases the lock), the key that
    seals its records, and the leaked pages the full check found (``None``: not checked)."""

    descriptor: StoreDescriptor
    env: lmdb.Environment
    dbs: dict[bytes, Any]
    lock_fd: int | None
    seal_key: SealKey
    leaked: Leak | None


def open_for_writing(
    path: Path, capacity_bytes: int | None, *, map_size: int | None, max_readers: int,
    sync: bool, full_check: bool,
) -> Opened:
    """Create or reopen the store at ``path`` under its writer lock.

    ``capacity_bytes=None`` keeps the recorded budget. :class:`DamagedStore` if
    ``data.mdb`` is damaged (``full_check``: every page checked, else its meta pages).
    """
    prepare_directory(path)
    check_is_store(path)
    lock_fd = lock_writer(path)
    env = None
    creating = False  # from the new store's descriptor on: undone if the open fails
    try:
        check_is_store(path)  # again, now that no other writer can be creating it
        make_private(path)
        marked = (path / DAMAGE_MARK_NAME).exists()
        leaked = check_file(path, full_check or marked)
        if marked:  # every page checked and found sound: the damage was not in the file
            (path / DAMAGE_MARK_NAME).unlink()
            logger.info("%s: checked every page after a damaged read; none is damaged", path)
        old = StoreDescriptor.load(path) if (path / DESCRIPTOR_NAME).exists() else None
        if old is not None and old.record_format_version > RECORD_FORMAT_VERSION:
            raise StoreError(
                f"{path} holds records of a newer format ({old.record_format_version}; this "
                f"build reads {RECORD_FORMAT_VERSION}); upgrade tiered-kv or use another directory"
            )
        # Records that no key of ours sealed (an older format, or a lost key file) cannot
        # be verified: they are dropped before the key is made and the descriptor updated.
        unverifiable = old is not None and (
            old.record_format_version < RECORD_FORMAT_VERSION
            or not (path / KEY_FILE_NAME).exists()
        )
        if capacity_bytes is None:
            if old is None:
                raise StoreError(f"{path}: a new store needs capacity_bytes")
            capacity_bytes = old.capacity_bytes
        seal_key = store_key(path, create=True) if old is None else None
        if map_size is None:
            map_size = max(default_map_size(capacity_bytes), old.map_size if old else 0)
        descriptor = StoreDescriptor(
            format=FORMAT_NAME,
            version=STORE_VERSION,
            created_ns=old.created_ns if old else time.time_ns(),
            capacity_bytes=capacity_bytes,
            map_size=map_size,
        )
        creating = old is None
        if descriptor != old and not unverifiable:
            _save(descriptor, path)
        try:
            env = open_env(path, readonly=False, sync=sync, map_size=map_size, max_readers=max_readers)
        except BaseException:
            if old is not None and descriptor != old and not unverifiable:
                _save(old, path)  # a budget whose map cannot be reserved: the store stays as it was
            raise
        env.reader_check()
        upgraded = 0
        with lmdb_errors(path), env.begin(write=True, buffers=True) as txn:
            dbs = {name: env.open_db(name, txn=txn) for name in DB_NAMES}
            stored = txn.get(b"format", db=dbs[DB_INFO])
            stored = None if stored is None else bytes(stored)
            if stored is None:
                txn.put(b"format", FORMAT_NAME.encode(), db=dbs[DB_INFO])
                txn.put(b"created_ns", U64.pack(descriptor.created_ns), db=dbs[DB_INFO])
            elif stored != FORMAT_NAME.encode():
                raise StoreError(f"{path}: the LMDB environment is not a tiered-kv store")
            version = str(STORE_VERSION).encode()
            stored = txn.get(b"version", db=dbs[DB_INFO])
            if stored is None or bytes(stored) != version:  # new, or an older version
                if stored is not None and not unverifiable:
                    upgraded = _name_parents(txn, dbs)
                txn.put(b"version", version, db=dbs[DB_INFO])
        if upgraded:
            logger.info(
                "%s: upgraded to store version %d: the metadata of %d records now names "
                "their parents (read from their headers), for chain-end eviction",
                path, STORE_VERSION, upgraded,
            )
        with lmdb_errors(path):
            if unverifiable:
                _drop_records(path, env, dbs)
            _match_meta_to_records(path, env, dbs)
        if seal_key is None:
            seal_key = store_key(path, create=True)
        if unverifiable:
            _save(descriptor, path)
    except BaseException:
        if env is not None:
            env.close()
        if creating:  # cut short (a full disk, a map too large): back to an empty directory
            for name in (DESCRIPTOR_NAME, DATA_NAME, LMDB_LOCK_NAME):
                with contextlib.suppress(OSError):
                    (path / name).unlink(missing_ok=True)
        os.close(lock_fd)
        raise
    return Opened(descriptor, env, dbs, lock_fd, seal_key, leaked)


def _save(descriptor: StoreDescriptor, path: Path) -> None:
    try:
        descriptor.save(path)
    except OSError as e:
        raise StoreError(f"{path}: cannot write the store descriptor: {e}") from None


def _drop_records(path: Path, env: lmdb.Environment, dbs: dict[bytes, Any]) -> None:
    """Delete every record (and its metadata) in one transaction: records no key of ours
    sealed must never be served, and a cache recomputes them."""
    with env.begin(write=True) as txn:
        count = txn.stat(dbs[DB_RECORDS])["entries"]
        txn.drop(dbs[DB_RECORDS], delete=False)
        txn.drop(dbs[DB_META], delete=False)
        txn.put(INFO_BYTES_USED, U64.pack(0), db=dbs[DB_INFO])
    if count:
        logger.warning(
            "%s: dropped %d records that were not sealed by this store's key (an older record "
            "format, or a lost %s); they will be recomputed", path, count, KEY_FILE_NAME,
        )


def open_for_reading(
    path: Path, *, map_size: int | None, sync: bool, full_check: bool
) -> Opened:
    """Open an existing store read-only; works while a writer has it."""
    if not path.is_dir():
        raise StoreError(f"no store at {path}")
    if not (path / DESCRIPTOR_NAME).exists():
        raise StoreError(f"{path} is not a tiered-kv disk store (no {DESCRIPTOR_NAME})")
    descriptor = StoreDescriptor.load(path)
    if not has_data(path):
        raise StoreError(
            f"{path}: the store has no data yet (never opened by a writer, or its creation "
            f"was cut short); `tiered-kv storage init {path}` completes it"
        )
    if descriptor.record_format_version > RECORD_FORMAT_VERSION:
        raise StoreError(
            f"{path} holds records of a newer format ({descriptor.record_format_version}; this "
            f"build reads {RECORD_FORMAT_VERSION}); upgrade tiered-kv"
        )
    if descriptor.record_format_version < RECORD_FORMAT_VERSION:
        raise StoreError(
            f"{path} holds records of format {descriptor.record_format_version}, this build "
            f"reads {RECORD_FORMAT_VERSION}; opening it for writing (`tiered-kv storage init "
            f"{path}`, or serve) drops records it cannot verify"
        )
    seal_key = store_key(path, create=False)
    leaked = check_file(path, full_check)
    # The writer's map size, so that this map always covers what the writer can commit.
    env = open_env(
        path, readonly=True, sync=sync, map_size=max(descriptor.map_size, map_size or 0),
        max_readers=DEFAULT_MAX_READERS,
    )
    try:
        env.reader_check()
        # Without a txn: a handle opened in a read txn dies with it.
        dbs = {name: env.open_db(name, create=False) for name in DB_NAMES}
    except lmdb.NotFoundError as e:
        env.close()
        raise StoreError(f"{path}: incomplete store ({e})") from None
    except lmdb.Error as e:
        env.close()
        raise DamagedStore(f"{path / DATA_NAME} is damaged ({e})") from None
    return Opened(descriptor, env, dbs, None, seal_key, leaked)


def check_file(path: Path, full: bool) -> Leak | None:
    """Before LMDB maps ``data.mdb``: its meta pages and size, and with ``full`` every
    page LMDB could reach. :class:`DamagedStore` if it must not be mapped.

    Returns the pages the full check found leaked, logged as a warning if there are any;
    ``None`` if it did not run (not ``full``, a new file, or a writer kept committing).
    """
    if check_data_file(path) is None or not full:
        return None
    check = check_structure(path)
    if check is None:  # a writer kept committing; the metas are fine
        return None
    problems = check.problems
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise DamagedStore(f"{path / DATA_NAME} is damaged: {problems[0]}{more}")
    leaked = check.leaked
    if leaked.pages:
        logger.warning(
            "%s: %d leaked pages (no tree, value or free list claims them: %s); LMDB never "
            "reuses them and `compact` refuses the file; `repair` rebuilds it without them",
            path / DATA_NAME, leaked.pages, leaked.listed(),
        )
    return leaked


@contextlib.contextmanager
def lmdb_errors(path: Path) -> Iterator[None]:
    """LMDB errors as store errors: a damaged file as :class:`DamagedStore`."""
    try:
        yield
    except DAMAGE_ERRORS as e:
        raise DamagedStore(f"{path / DATA_NAME} is damaged ({e})") from None
    except lmdb.Error as e:
        raise StoreError(f"{path}: {e}") from None


def _name_parents(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> int:
    """Rewrite the ``meta`` values of an older store version (no parent hash) in the
    current layout, each parent read from its record's header (a page of each record,
    zero-copy): once, in the transaction that records the new version, so that a store is
    upgraded whole or not at all. How many values were rewritten."""
    records, meta = dbs[DB_RECORDS], dbs[DB_META]
    upgraded = []
    for key, value in txn.cursor(db=meta):
        old = unpack_meta(value) if len(value) != META.size else None
        record = txn.get(key, db=records) if old is not None else None
        if record is not None:  # a value without a record is _match_meta_to_records' business
            parent = stated_parent_hash(record)
            upgraded.append((bytes(key), pack_meta(
                old.last_access_ns, old.nbytes, old.created_ns, old.priority, parent,
            )))
    if upgraded:
        txn.cursor(db=meta).putmulti(upgraded)
    return len(upgraded)


def _match_meta_to_records(path: Path, env: lmdb.Environment, dbs: dict[bytes, Any]) -> None:
    """After a crash between the two, rebuild the ``meta`` db from ``records``."""
    records, meta = dbs[DB_RECORDS], dbs[DB_META]
    with env.begin() as txn:
        if txn.stat(records)["entries"] == txn.stat(meta)["entries"]:
            return
    with env.begin(write=True, buffers=True) as txn:
        sizes = {bytes(k): len(v) for k, v in txn.cursor(db=records)}
        stale = [bytes(k) for k in txn.cursor(db=meta).iternext(values=False)]
        for key in stale:
            if key not in sizes:
                txn.delete(key, db=meta)
        for key, size in sizes.items():
            if txn.get(key, db=meta) is None:
                # Unknown access: evicted first among the default priority. The parent its
                # header names keeps the record's chain in the eviction order.
                parent = stated_parent_hash(txn.get(key, db=records))
                txn.put(key, pack_meta(0, size, 0, DEFAULT_PRIORITY, parent), db=meta)
        txn.put(INFO_BYTES_USED, U64.pack(sum(sizes.values())), db=dbs[DB_INFO])
    logger.warning("%s: metadata disagreed with records; rebuilt it", path)
