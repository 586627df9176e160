"""The disk tier: checksummed records in one LMDB environment per cache directory.

:class:`LmdbStore` is the store API. This module opens the store and holds its index (the
eviction order), stats, flush and close; its other parts live beside it:

- :mod:`storage.lmdb_layout`: the directory, descriptor, writer lock and LMDB options;
- :mod:`storage.lmdb_file`: ``data.mdb`` checked without mapping it;
- :mod:`storage.lmdb_reader`: lookups, reads, verification and key listings;
- :mod:`storage.lmdb_writes`: puts and deletes, eviction to the capacity;
- :mod:`storage.lmdb_eviction`: the eviction order: priority, chain ends first, LRU;
- :mod:`storage.lmdb_committer`: pending operations and the writer thread;
- :mod:`storage.lmdb_meta`: the ``meta`` db's values;
- :mod:`storage.lmdb_recovery`: a full map, a full or failing disk;
- :mod:`storage.lmdb_admin`: verify, quarantine, compaction, info;
- :mod:`storage.lmdb_listing`: namespaces, metadata, raw and verified records;
- :mod:`storage.lmdb_repair`: a damaged store's readable records salvaged into a fresh one;
- :mod:`storage.lmdb_salvage`: what repair salvages from a damaged ``data.mdb``.

Sub-databases: ``records`` (key → encoded :class:`~storage.record.Record`), ``meta`` (key →
last access, size, created, priority, parent hash), ``quarantine`` (key → reason and the
head of a record that failed verification) and ``info`` (format name, version, bytes used).

Threads
    Any thread may call any method. ``put``/``delete`` only update in-memory state (the
    index and a map of pending operations) and return; one writer thread commits the
    pending operations in batched write transactions. Reads use short read transactions.

``on_evict``
    Called with every key that leaves the store other than through ``delete``: evicted
    (counted in ``evictions``), quarantined as corrupt, or accepted by ``put`` but never
    committable (counted in ``dropped``). It runs outside every lock, on the thread whose
    call caused it or on the writer thread; it must be quick and must not call ``flush``.

Capacity
    ``capacity_bytes`` bounds the encoded records readers see (committed plus pending);
    :mod:`storage.lmdb_writes` says which records a put evicts and when it is refused.
    See ``docs/disk_tier.md`` for the crash-safety guarantees.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np

from storage.base import BlockKey, BlockStore, StoreError, StoreStats
from storage.lmdb_admin import Admin, QuarantineEntry, StoreInfo, VerifyResult
from storage.lmdb_committer import QUARANTINE_KEEP_BYTES, Committer
from storage.lmdb_eviction import ChainLru
from storage.lmdb_file import DamagedStore, check_data_file, check_structure
from storage.lmdb_directory import LOCK_NAME, move_aside
from storage.lmdb_descriptor import (
    FORMAT_NAME, STORE_VERSION, MiB, StoreDescriptor, default_map_size,
)
from storage.lmdb_layout import (
    DB_INFO, DB_META, DB_RECORDS, DEFAULT_MAX_READERS, DESCRIPTOR_NAME, INFO_BYTES_USED, U64,
    Opened, lmdb_errors, open_for_reading, open_for_writing,
)
from storage.lmdb_listing import Listing, RecordMeta
from storage.lmdb_meta import unpack_columns
from storage.lmdb_pages import Leak
from storage.lmdb_reader import Reader
from storage.lmdb_recovery import Recovery
from storage.lmdb_repair import Repair, RepairResult
from storage.lmdb_writes import Writes
from storage.record import Record

__all__ = [
    "DESCRIPTOR_NAME", "FORMAT_NAME", "LOCK_NAME", "QUARANTINE_KEEP_BYTES", "STORE_VERSION", "DamagedStore",
    "LmdbStats", "LmdbStore", "QuarantineEntry", "RecordMeta", "RepairResult",
    "StoreDescriptor", "StoreInfo", "VerifyResult", "check_data_file", "check_structure",
    "default_map_size",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_BYTES = 64 * MiB
DEFAULT_MAX_BATCH_ITEMS = 512
DEFAULT_MAX_PENDING_BYTES = 256 * MiB


@dataclasses.dataclass
class LmdbStats(StoreStats):
    """:class:`StoreStats` plus what only the disk has."""

    write_errors: int = 0  # commits that failed on a full or failing disk (see degraded)


class LmdbStore(Writes, Admin, Listing, Repair, Reader, Recovery, Committer, BlockStore[Record]):
    """LMDB-backed block store holding encoded :class:`Record` s.

    ``capacity_bytes`` may be ``None`` to use the capacity recorded in an existing store.
    ``sync=False`` skips the fsync of each commit; :meth:`flush` and :meth:`close` then
    fsync explicitly, so what they acknowledge is durable either way.
    ``readonly=True`` opens an existing store for reading only; it works while another
    process writes to it. Such a store never quarantines (it only counts corruption) and
    does not track access order.

    ``data.mdb`` is checked against its meta pages before LMDB maps it: a truncated or
    damaged file raises :class:`DamagedStore`, never a signal. ``full_check=True`` also
    walks every page LMDB could reach (one read of the B-tree pages and of each overflow
    run's header; given up if a writer in another process keeps committing): for admin
    tools that read everything. Pages it finds no owner for are logged and kept in
    :attr:`leaked` (``None`` without a full check): lost space, not damage.
    ``replace_damaged=True`` (writers only) moves a damaged store aside to
    ``<dir>.damaged-<time>`` (see :attr:`moved_aside`) and starts an empty one instead.
    ``seal_key`` is the key of the store's ``seal.key``, which a writer creates with the
    store; records are sealed and verified with it (see ``docs/record_format.md``).
    """

    tier = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        *,
        readonly: bool = False,
        sync: bool = True,
        map_size: int | None = None,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        max_batch_items: int = DEFAULT_MAX_BATCH_ITEMS,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        max_readers: int = DEFAULT_MAX_READERS,
        access_flush_interval: float = 1.0,
        reader_check_interval: float = 30.0,
        full_check: bool = False,
        replace_damaged: bool = False,
        on_evict: Callable[[BlockKey], None] | None = None,
    ) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if map_size is not None and map_size < MiB:
            raise ValueError(f"map_size must be at least 1 MiB, got {map_size}")
        if max_batch_bytes <= 0 or max_batch_items <= 0 or max_pending_bytes <= 0:
            raise ValueError("batch and pending limits must be positive")
        self.path = Path(path)
        self.readonly = readonly
        self.sync = sync
        self._max_batch_bytes = max_batch_bytes
        self._max_batch_items = max_batch_items
        self._max_pending_bytes = max_pending_bytes
        self._access_flush_interval = access_flush_interval
        self._reader_check_interval = reader_check_interval
        self._on_evict = on_evict

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the writer waits here
        self._progress = threading.Condition(self._lock)  # flush() and backpressure wait here
        self._index = ChainLru()  # key -> size, in eviction order
        self._used = 0
        self._touched: dict[bytes, int] = {}
        self._stats = LmdbStats(tier=self.tier)
        self._closing = False
        self._notifying = False  # the writer has a batch whose leavers on_evict has not heard of
        self._closed = False
        self._damage_seen = False  # a read met a damaged page (see _unreadable)
        self._lock_fd: int | None = None
        self._env: lmdb.Environment | None = None
        self._init_committer()
        self._init_recovery()
        self.moved_aside: Path | None = None  # where replace_damaged put a damaged store
        self.leaked: Leak | None = None  # pages the full check found leaked (None: no check)

        def open_store() -> Opened:
            if readonly:
                return open_for_reading(
                    self.path, map_size=map_size, sync=sync, full_check=full_check
                )
            return open_for_writing(
                self.path, capacity_bytes, map_size=map_size, max_readers=max_readers,
                sync=sync, full_check=full_check,
            )

        def open_and_index() -> None:
            opened = open_store()
            self.descriptor, self._env, self._dbs, self._lock_fd, self.seal_key, self.leaked = opened
            if not readonly:
                try:
                    self._load_index()  # reads the whole meta db: a damaged page shows here
                except BaseException:
                    self._release()
                    raise

        try:
            open_and_index()
        except DamagedStore as e:
            if readonly or not replace_damaged:
                raise
            if capacity_bytes is None:
                capacity_bytes = StoreDescriptor.load(self.path).capacity_bytes
            self.moved_aside = move_aside(self.path)
            logger.warning("%s; moved it to %s and started an empty store", e, self.moved_aside)
            open_and_index()
        self.capacity_bytes = self.descriptor.capacity_bytes
        self._stats.capacity_bytes = self.capacity_bytes
        self.map_size = self._env.info()["map_size"]
        # Larger records are refused at put: one could need every other record evicted.
        self.max_record_bytes = min(self.capacity_bytes, self.map_size // 2)
        if not readonly:
            with self._lock:  # a store reopened with a smaller budget sheds its oldest
                evicted = self._evict_to_budget_locked()
            self._start_writer()
            atexit.register(self.close)
            self._notify_gone(evicted)

    def _load_index(self) -> None:
        """Rebuild the eviction order from the meta db: each record at its priority, filed
        by whether a record here names it as parent, least recently accessed first."""
        with lmdb_errors(self.path), self._env.begin(db=self._dbs[DB_META]) as txn:
            items = list(txn.cursor())
        metas = unpack_columns([value for _, value in items])
        if isinstance(metas, int):
            raise StoreError(
                f"{self.path}: the meta db holds a {metas}-byte value, which no store version "
                f"up to {STORE_VERSION} writes; not a store this build reads"
            )
        # by last access; a stable sort leaves a tie in key order, the cursor's
        order = np.argsort(metas.last_access_ns, kind="stable").tolist()
        sizes = metas.nbytes[order].tolist()
        self._index = ChainLru.build(
            [items[i][0] for i in order], sizes, metas.priority[order].tolist(),
            [metas.parent_hash[i] for i in order],
        )
        self._used = self._disk_bytes = sum(sizes)

    def _lmdb_errors(self) -> contextlib.AbstractContextManager[None]:
        return lmdb_errors(self.path)

    # ------------------------------------------------------------------ stats

    def stats(self) -> LmdbStats:
        with self._lock:
            self._check_open()
            snapshot = dataclasses.replace(self._stats)
            if not self.readonly:
                snapshot.entries = len(self._index)
                snapshot.bytes_used = self._used
                return snapshot
        with self._lmdb_errors(), self._env.begin() as txn:
            snapshot.entries = txn.stat(self._dbs[DB_RECORDS])["entries"]
            used = txn.get(INFO_BYTES_USED, db=self._dbs[DB_INFO])
            snapshot.bytes_used = U64.unpack(used)[0] if used is not None else 0
        return snapshot

    @property
    def removals(self) -> int:
        """How many keys have left this store since it opened (evicted, deleted, dropped,
        quarantined): while it stays the same, every key :meth:`contains` found is still
        here. A read-only store keeps no index of another process's writes: it raises."""
        if self.readonly:
            raise RuntimeError(f"{self.path}: a read-only store cannot count removals")
        with self._lock:
            return self._index.removals

    @property
    def pending_bytes(self) -> int:
        """Bytes of puts accepted but not yet committed (what backpressure bounds)."""
        with self._lock:
            return self._pending_bytes

    # ------------------------------------------------------------------ flush and close

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued before the call is committed (and fsynced).

        ``False`` if ``timeout`` passed first, or if a change accepted since the previous
        flush (a put, a delete, a quarantine) was given up instead of committed (a full or
        failing disk: see :attr:`degraded`), so True always means nothing accepted was lost.
        """
        if self.readonly:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._check_writable()
            if not self._wait_committed_locked(self._seq, deadline):
                return False
            lost = self._take_lost_locked()
        if not self.sync and not self._fsync():
            return False
        return lost == 0

    def close(self) -> None:
        """Commit everything pending, stop the writer and close the environment. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._stop_writer()
        self._mark_closed()
        if self._env is not None and not self.readonly and not self.sync:
            self._fsync()
        self._release()

    def _mark_closed(self) -> None:
        """No call may use the store from now on (the writer has stopped)."""
        if self._writer is not None:
            atexit.unregister(self.close)
        with self._lock:
            self._closed = True
            self._progress.notify_all()

    def _fsync(self) -> bool:
        try:
            self._env.sync(True)
        except lmdb.Error as e:
            with self._lock:
                self._stats.write_errors += 1
            logger.warning("%s: fsync failed: %s", self.path, e)
            return False
        return True

    def _release(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.path}: the store is closed")

    def _check_writable(self) -> None:
        if self.readonly:
            raise StoreError(f"{self.path} is open read-only")
        if self._closing:
            raise StoreError(f"{self.path}: the store is closed")
