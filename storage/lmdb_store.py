"""The disk tier: checksummed records in one LMDB environment per cache directory.

Directory layout (created 0700)::

    <dir>/tiered_kv.json   descriptor: format name, store version, capacity, map size...
    <dir>/writer.lock      flock()ed by the one process that may write
    <dir>/data.mdb         LMDB data file (a sparse map reserved up front)
    <dir>/lock.mdb         LMDB reader table, shared by the writer and read-only admin tools

Sub-databases: ``records`` (key → encoded :class:`~storage.record.Record`), ``meta`` (key →
last access, size, created), ``quarantine`` (key → reason and the head of a record that
failed verification) and ``info`` (format name, version, bytes used).

Threads
    Any thread may call any method. ``put``/``delete`` only update in-memory state (the
    LRU index and a map of pending operations) and return; one writer thread commits the
    pending operations in batched write transactions. Reads use short read transactions
    and copy the bytes out before the transaction ends.

``on_evict``
    Called with every key that leaves the store other than through ``delete``: evicted
    (counted in ``evictions``), quarantined as corrupt, or accepted by ``put`` but never
    committable (counted in ``dropped``). It runs outside every lock, on the thread whose
    call caused it or on the writer thread; it must be quick and must not call ``flush``.

Capacity
    ``capacity_bytes`` bounds the sum of encoded record sizes of the store as seen by
    readers (committed plus pending). A ``put`` that would exceed it evicts the least
    recently accessed keys at once; the writer deletes them in the same transaction that
    stores the new record. See ``docs/disk_tier.md`` for the crash-safety guarantees.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import enum
import errno
import fcntl
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import lmdb

from storage.base import KEY_SIZE, BlockKey, BlockStore, StoreError, StoreStats
from storage.record import FORMAT_VERSION as RECORD_FORMAT_VERSION
from storage.record import Record, RecordError, decode_record, encode_record

logger = logging.getLogger(__name__)

FORMAT_NAME = "tiered-kv-lmdb"
STORE_VERSION = 1
DESCRIPTOR_NAME = "tiered_kv.json"
LOCK_NAME = "writer.lock"
_DESCRIPTOR_TMP = ".tiered_kv.json.tmp"
# What a directory may hold and still count as empty: leftovers of a creation cut short.
_CREATION_LEFTOVERS = frozenset({LOCK_NAME, _DESCRIPTOR_TMP})

_DB_RECORDS = b"records"
_DB_META = b"meta"
_DB_QUARANTINE = b"quarantine"
_DB_INFO = b"info"
_DB_NAMES = (_DB_RECORDS, _DB_META, _DB_QUARANTINE, _DB_INFO)

_INFO_FORMAT = b"format"
_INFO_VERSION = b"version"
_INFO_CREATED = b"created_ns"
_INFO_BYTES_USED = b"bytes_used"

_META = struct.Struct("<QQQ")  # last access ns, encoded size, created ns
_U64 = struct.Struct("<Q")
_QUARANTINE_HEAD = struct.Struct("<QQH")  # quarantined ns, original size, reason length
# Enough of a bad record to read its header (key, shape, codec, token ids) offline.
QUARANTINE_KEEP_BYTES = 4096

MiB = 1 << 20
DEFAULT_MAX_BATCH_BYTES = 64 * MiB
DEFAULT_MAX_BATCH_ITEMS = 512
DEFAULT_MAX_PENDING_BYTES = 256 * MiB
DEFAULT_MAX_READERS = 256
_KEYS_CHUNK = 1024


def default_map_size(capacity_bytes: int) -> int:
    """Address space reserved for ``capacity_bytes`` of records.

    Twice the budget plus 64 MiB: overflow pages round every record up to whole pages,
    pages freed by a commit are reusable only two commits later (copy-on-write keeps the
    previous snapshot intact), and the B-trees and free list need room of their own.
    """
    return -(-(2 * capacity_bytes + 64 * MiB) // MiB) * MiB


@dataclasses.dataclass(frozen=True)
class StoreDescriptor:
    """The contents of ``tiered_kv.json``."""

    format: str
    version: int
    created_ns: int
    capacity_bytes: int
    map_size: int
    record_format_version: int = RECORD_FORMAT_VERSION
    lmdb_version: str = ".".join(map(str, lmdb.version()))

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["created"] = time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_ns / 1e9)
        )
        return json.dumps(fields, indent=2, sort_keys=True) + "\n"

    @classmethod
    def load(cls, path: Path) -> StoreDescriptor:
        """Read and check a store's descriptor; :class:`StoreError` if it is not ours."""
        where = path / DESCRIPTOR_NAME
        try:
            fields = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreError(f"{where}: unreadable store descriptor ({e})") from None
        if not isinstance(fields, dict) or fields.get("format") != FORMAT_NAME:
            raise StoreError(f"{path} is not a tiered-kv disk store ({where} names another format)")
        version = fields.get("version")
        if not isinstance(version, int):
            raise StoreError(f"{where}: the store version is missing")
        if version > STORE_VERSION:
            raise StoreError(
                f"{path} was written by a newer tiered-kv (store version {version}; this build "
                f"reads up to {STORE_VERSION}); upgrade tiered-kv or use another directory"
            )
        try:
            return cls(
                format=FORMAT_NAME,
                version=version,
                created_ns=int(fields["created_ns"]),
                capacity_bytes=int(fields["capacity_bytes"]),
                map_size=int(fields["map_size"]),
                record_format_version=int(fields.get("record_format_version", 1)),
                lmdb_version=str(fields.get("lmdb_version", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{where}: malformed store descriptor ({e})") from None

    def save(self, path: Path) -> None:
        """Replace the descriptor atomically (write, fsync, rename, fsync the directory)."""
        tmp = path / _DESCRIPTOR_TMP
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, self.to_json().encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path / DESCRIPTOR_NAME)
        _fsync_dir(path)


class QuarantineEntry(NamedTuple):
    """A record moved aside because it failed verification."""

    key: BlockKey
    reason: str
    quarantined_ns: int
    nbytes: int  # size of the bad record; only its first QUARANTINE_KEEP_BYTES are kept
    head: bytes


class VerifyResult(NamedTuple):
    """What :meth:`LmdbStore.verify` found."""

    checked: int
    ok: int
    corrupt: int
    quarantined: int  # 0 for a read-only store, which can only report
    bytes_checked: int


@dataclasses.dataclass(frozen=True)
class StoreInfo:
    """The descriptor plus what the environment reports, for the admin CLI."""

    path: str
    readonly: bool
    descriptor: StoreDescriptor
    entries: int
    bytes_used: int
    quarantined: int
    data_file_bytes: int  # allocated on disk (the map is sparse)
    map_size: int
    last_page: int
    page_size: int
    reader_pids: tuple[int, ...]  # other processes holding a slot in the reader table


class RecordMeta(NamedTuple):
    """A committed record's metadata, as the ``meta`` db holds it (no record bytes read)."""

    key: BlockKey
    last_access_ns: int  # 0 when unknown (metadata rebuilt after a crash)
    nbytes: int
    created_ns: int


class _Op(enum.Enum):
    PUT = "put"
    DELETE = "delete"
    QUARANTINE = "quarantine"


@dataclasses.dataclass(slots=True)
class _Pending:
    """The newest not-yet-committed operation on one key.

    ``seq`` numbers the latest change; ``first_seq`` the oldest change not yet covered by a
    commit (what :meth:`LmdbStore.flush` waits for). While the writer holds a snapshot of
    the entry (``queued`` false), a new change goes to ``next_first`` and re-queues the key.
    """

    op: _Op
    data: bytes | None
    reason: str
    seq: int
    first_seq: int
    put_ns: int
    created_ns: int
    queued: bool = True
    next_first: int | None = None


class _Snap(NamedTuple):
    """What the writer commits for one key: a copy of its pending entry at ``seq``."""

    key: bytes
    seq: int
    op: _Op
    data: bytes | None
    reason: str
    put_ns: int
    created_ns: int


class LmdbStore(BlockStore[Record]):
    """LMDB-backed block store holding encoded :class:`Record` s.

    ``capacity_bytes`` may be ``None`` to use the capacity recorded in an existing store.
    ``sync=False`` skips the fsync of each commit; :meth:`flush` and :meth:`close` then
    fsync explicitly, so what they acknowledge is durable either way.
    ``readonly=True`` opens an existing store for reading only; it works while another
    process writes to it. Such a store never quarantines (it only counts corruption) and
    does not track access order.
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
        self._pending: dict[bytes, _Pending] = {}
        self._queue: collections.deque[bytes] = collections.deque()
        self._pending_bytes = 0
        self._seq = 0
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self._used = 0
        self._touched: dict[bytes, int] = {}
        self._stats = StoreStats(tier=self.tier)
        self._closing = False
        self._closed = False
        self._writer: threading.Thread | None = None
        self._writer_ident: int | None = None
        self._lock_fd: int | None = None
        self._env: lmdb.Environment | None = None
        self._disk_bytes = 0  # committed bytes as the writer thread knows them

        try:
            if readonly:
                self.descriptor = self._open_reader(map_size)
            else:
                self.descriptor = self._open_writer(capacity_bytes, map_size, max_readers)
                self._load_index()
        except BaseException:
            self._release()
            raise
        self.capacity_bytes = self.descriptor.capacity_bytes
        self._stats.capacity_bytes = self.capacity_bytes
        self.map_size = self._env.info()["map_size"]
        # Larger records are refused at put: one could need every other record evicted.
        self.max_record_bytes = min(self.capacity_bytes, self.map_size // 2)
        if not readonly:
            with self._lock:  # a store reopened with a smaller budget sheds its oldest
                evicted = self._evict_to_budget_locked()
            self._writer = threading.Thread(
                target=self._run, name=f"lmdb-writer:{self.path.name}", daemon=True
            )
            self._writer.start()
            atexit.register(self.close)
            self._notify_gone(evicted)

    # ------------------------------------------------------------------ opening

    def _lmdb_open(self, map_size: int, max_readers: int) -> lmdb.Environment:
        try:
            return lmdb.open(
                str(self.path),
                subdir=True,  # data.mdb and lock.mdb live in the store directory
                readonly=self.readonly,  # admin readers map the file read-only, never write
                create=False,  # we create the directory ourselves: 0700, descriptor first
                mode=0o700,  # LMDB drops the x bits: data and lock files are 0600
                map_size=map_size,  # sparse, reserved once; a full map evicts, never resizes
                max_dbs=len(_DB_NAMES),  # records, meta, quarantine, info
                sync=self.sync,  # fsync each commit; with False, flush()/close() fsync
                metasync=self.sync,  # the meta page makes a commit durable: sync it too
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
        except lmdb.Error as e:
            raise StoreError(f"{self.path}: cannot open the LMDB environment: {e}") from None

    def _open_writer(
        self, capacity_bytes: int | None, map_size: int | None, max_readers: int
    ) -> StoreDescriptor:
        path = self.path
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
            raise StoreError(f"{path} is not writable; open it with readonly=True to read it")
        self._check_is_store(path)
        self._lock_writer(path)
        self._check_is_store(path)  # again, now that no other writer can be creating it

        existing = (path / DESCRIPTOR_NAME).exists()
        old = StoreDescriptor.load(path) if existing else None
        if capacity_bytes is None:
            if old is None:
                raise StoreError(f"{path}: a new store needs capacity_bytes")
            capacity_bytes = old.capacity_bytes
        if map_size is None:
            map_size = max(default_map_size(capacity_bytes), old.map_size if old else 0)
        descriptor = StoreDescriptor(
            format=FORMAT_NAME,
            version=STORE_VERSION,
            created_ns=old.created_ns if old else time.time_ns(),
            capacity_bytes=capacity_bytes,
            map_size=map_size,
        )
        if descriptor != old:
            try:
                descriptor.save(path)
            except OSError as e:
                raise StoreError(f"{path}: cannot write the store descriptor: {e}") from None

        self._env = self._lmdb_open(map_size, max_readers)
        self._env.reader_check()
        try:
            with self._env.begin(write=True) as txn:
                self._dbs = {name: self._env.open_db(name, txn=txn) for name in _DB_NAMES}
                info = self._dbs[_DB_INFO]
                stored = txn.get(_INFO_FORMAT, db=info)
                if stored is None:
                    txn.put(_INFO_FORMAT, FORMAT_NAME.encode(), db=info)
                    txn.put(_INFO_VERSION, str(STORE_VERSION).encode(), db=info)
                    txn.put(_INFO_CREATED, _U64.pack(descriptor.created_ns), db=info)
                elif stored != FORMAT_NAME.encode():
                    raise StoreError(f"{path}: the LMDB environment is not a tiered-kv store")
        except lmdb.Error as e:
            raise StoreError(f"{path}: cannot initialise the store: {e}") from None
        return descriptor

    def _open_reader(self, map_size: int | None) -> StoreDescriptor:
        path = self.path
        if not path.is_dir():
            raise StoreError(f"no store at {path}")
        if not (path / DESCRIPTOR_NAME).exists():
            raise StoreError(f"{path} is not a tiered-kv disk store (no {DESCRIPTOR_NAME})")
        descriptor = StoreDescriptor.load(path)
        if not (path / "data.mdb").exists():
            raise StoreError(f"{path}: the store has no data yet (never opened by a writer)")
        # The writer's map size, so that this map always covers what the writer can commit.
        self._env = self._lmdb_open(max(descriptor.map_size, map_size or 0), DEFAULT_MAX_READERS)
        self._env.reader_check()
        try:
            # Without a txn: a handle opened in a read txn dies with it.
            self._dbs = {name: self._env.open_db(name, create=False) for name in _DB_NAMES}
        except lmdb.Error as e:
            raise StoreError(f"{path}: incomplete store ({e})") from None
        return descriptor

    @staticmethod
    def _check_is_store(path: Path) -> None:
        if (path / DESCRIPTOR_NAME).exists():
            StoreDescriptor.load(path)
            return
        try:
            others = set(os.listdir(path)) - _CREATION_LEFTOVERS
        except OSError as e:
            raise StoreError(f"cannot list {path}: {e}") from None
        if others:
            raise StoreError(
                f"{path} is not empty and has no {DESCRIPTOR_NAME}: not a tiered-kv disk store; "
                "refusing to use it"
            )

    def _lock_writer(self, path: Path) -> None:
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
        self._lock_fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)

    def _load_index(self) -> None:
        """Rebuild the LRU index from the meta db, repairing it if it disagrees with records."""
        records, meta = self._dbs[_DB_RECORDS], self._dbs[_DB_META]
        with self._env.begin() as txn:
            consistent = txn.stat(records)["entries"] == txn.stat(meta)["entries"]
        if not consistent:
            self._repair_meta()
        entries = []
        with self._env.begin(db=meta) as txn:
            for key, value in txn.cursor():
                access_ns, size, _ = _META.unpack(value)
                entries.append((access_ns, key, size))
        entries.sort()
        self._index = collections.OrderedDict((key, size) for _, key, size in entries)
        self._used = sum(self._index.values())
        self._disk_bytes = self._used

    def _repair_meta(self) -> None:
        records, meta = self._dbs[_DB_RECORDS], self._dbs[_DB_META]
        with self._env.begin(write=True, buffers=True) as txn:
            sizes = {bytes(k): len(v) for k, v in txn.cursor(db=records)}
            stale = [bytes(k) for k in txn.cursor(db=meta).iternext(values=False)]
            for key in stale:
                if key not in sizes:
                    txn.delete(key, db=meta)
            for key, size in sizes.items():
                if txn.get(key, db=meta) is None:
                    txn.put(key, _META.pack(0, size, 0), db=meta)  # unknown access: evict first
            txn.put(_INFO_BYTES_USED, _U64.pack(sum(sizes.values())), db=self._dbs[_DB_INFO])
        logger.warning("%s: metadata disagreed with records; rebuilt it", self.path)

    # ------------------------------------------------------------------ reads

    def contains(self, key: BlockKey) -> bool:
        kb = key.to_bytes()
        if self.readonly:
            return self.contains_many([key])[0]
        with self._lock:
            self._check_open()
            return kb in self._index

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        kbs = [k.to_bytes() for k in keys]
        if self.readonly:
            self._check_open()
            with self._env.begin(db=self._dbs[_DB_RECORDS], buffers=True) as txn:
                return [txn.get(kb) is not None for kb in kbs]
        with self._lock:
            self._check_open()
            return [kb in self._index for kb in kbs]

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        if self.readonly:
            present = self.contains_many(keys)
            return present.index(False) if False in present else len(present)
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                if key.to_bytes() not in self._index:
                    return i
        return len(keys)

    def get(self, key: BlockKey) -> Record | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[BlockKey]) -> list[Record | None]:
        """Values for ``keys``, read in one short read transaction."""
        with self._read(keys, copy=True) as records:
            return records

    @contextlib.contextmanager
    def reading(self, keys: Sequence[BlockKey]) -> Iterator[list[Record | None]]:
        """Values for ``keys`` whose payloads are views of the memory map, not copies: valid
        inside the ``with`` block, whose read transaction keeps the pages in place."""
        with self._read(keys, copy=False) as records:
            yield records

    @contextlib.contextmanager
    def _read(self, keys: Sequence[BlockKey], *, copy: bool) -> Iterator[list[Record | None]]:
        kbs = [k.to_bytes() for k in keys]
        found: list[bytes | memoryview | None] = [None] * len(kbs)
        to_read: list[int] = []
        with self._lock:
            self._check_open()
            for i, kb in enumerate(kbs):
                entry = self._pending.get(kb)
                if entry is not None:
                    found[i] = entry.data  # None for a pending delete or quarantine
                elif self.readonly or kb in self._index:
                    to_read.append(i)
        txn = None
        try:
            if to_read:
                try:
                    txn = self._env.begin(db=self._dbs[_DB_RECORDS], buffers=True)
                    for i in to_read:
                        buf = txn.get(kbs[i])
                        if buf is not None:
                            found[i] = bytes(buf) if copy else buf
                except lmdb.Error as e:  # a damaged file or a map outgrown: misses, not a crash
                    logger.error("%s: read failed: %s", self.path, e)
            yield self._verify(keys, kbs, found)
        finally:
            if txn is not None:
                txn.abort()  # a read transaction: ends it, and the views with it

    def _verify(
        self, keys: Sequence[BlockKey], kbs: list[bytes], found: list[bytes | memoryview | None]
    ) -> list[Record | None]:
        """Decode and check what was read, count hits and misses, quarantine the corrupt."""
        results: list[Record | None] = [None] * len(kbs)
        bad: list[tuple[bytes, RecordError]] = []
        for i, data in enumerate(found):
            if data is None:
                continue
            try:
                results[i] = decode_record(data, expected_key=keys[i])
            except RecordError as e:
                bad.append((kbs[i], e))
        now = time.time_ns()
        with self._lock:
            for i, record in enumerate(results):
                if record is None:
                    self._stats.misses += 1
                    continue
                self._stats.hits += 1
                self._stats.bytes_read += len(found[i])
                if kbs[i] in self._index:
                    self._index.move_to_end(kbs[i])
                    self._touched[kbs[i]] = now
            gone = [kb for kb, error in bad if self._corrupt_locked(kb, error)]
        self._notify_gone(gone)
        return results

    def _corrupt_locked(self, kb: bytes, error: RecordError) -> bool:
        """Count a record that failed verification; True if the writer will quarantine it."""
        self._stats.corrupt += 1
        logger.warning("%s: corrupt record %s: %s", self.path, _short(kb), error)
        if self.readonly or kb in self._pending or kb not in self._index:
            return False  # read-only, or already replaced or removed since it was read
        self._used -= self._index.pop(kb)
        self._touched.pop(kb, None)
        self._enqueue_locked(kb, _Op.QUARANTINE, None, reason=f"{error.reason}: {error}")
        return True

    def keys(self, namespace: bytes | None = None) -> Iterator[BlockKey]:
        """Present keys, read in chunks of short transactions; pending puts come first."""
        pending_puts: list[bytes] = []
        pending_keys: set[bytes] = set()
        with self._lock:
            self._check_open()
            for kb, entry in self._pending.items():
                pending_keys.add(kb)
                if entry.op is _Op.PUT and (namespace is None or kb.startswith(namespace)):
                    pending_puts.append(kb)
        for kb in pending_puts:
            yield BlockKey.from_bytes(kb)
        for chunk in self._committed_key_chunks(namespace):
            if not self.readonly:
                with self._lock:
                    chunk = [kb for kb in chunk if kb in self._index]
            for kb in chunk:
                if kb not in pending_keys:
                    yield BlockKey.from_bytes(kb)

    def _committed_key_chunks(self, namespace: bytes | None) -> Iterator[list[bytes]]:
        """Committed record keys in key order, each chunk from its own read transaction."""
        prefix = namespace or b""
        last: bytes | None = None
        while True:
            chunk: list[bytes] = []
            with self._env.begin(db=self._dbs[_DB_RECORDS]) as txn:
                cursor = txn.cursor()
                more = cursor.set_range(last if last is not None else prefix)
                if more and last is not None and cursor.key() == last:
                    more = cursor.next()
                while more and len(chunk) < _KEYS_CHUNK:
                    kb = cursor.key()
                    if not kb.startswith(prefix):
                        more = False
                        break
                    if len(kb) == KEY_SIZE:
                        chunk.append(kb)
                    last = kb
                    more = cursor.next()
            if chunk:
                yield chunk
            if not more:
                return

    def stats(self) -> StoreStats:
        with self._lock:
            self._check_open()
            snapshot = dataclasses.replace(self._stats)
            if not self.readonly:
                snapshot.entries = len(self._index)
                snapshot.bytes_used = self._used
                return snapshot
        with self._env.begin() as txn:
            snapshot.entries = txn.stat(self._dbs[_DB_RECORDS])["entries"]
            used = txn.get(_INFO_BYTES_USED, db=self._dbs[_DB_INFO])
            snapshot.bytes_used = _U64.unpack(used)[0] if used is not None else 0
        return snapshot

    @property
    def pending_bytes(self) -> int:
        """Bytes of puts accepted but not yet committed (what backpressure bounds)."""
        with self._lock:
            return self._pending_bytes

    # ------------------------------------------------------------------ writes

    def put(self, key: BlockKey, value: Record) -> bool:
        return self.put_many([(key, value)])[0]

    def put_many(self, items: Iterable[tuple[BlockKey, Record]]) -> list[bool]:
        """Queue records for the writer, in groups of up to one write batch.

        Records are encoded on the calling thread; each group is queued at once, so the
        writer commits it in one transaction.
        """
        self._check_writable()
        results: list[bool] = []
        evicted: list[bytes] = []
        group: list[tuple[bytes, bytes | None, int]] = []
        group_bytes = 0
        for key, record in items:
            key.validate()
            if record.key != key:
                raise ValueError(f"record is for {record.key.short()}, put under {key.short()}")
            data = encode_record(record)
            if len(data) > self.max_record_bytes:
                data = None
            group.append((key.to_bytes(), data, record.created_ns))
            group_bytes += len(data) if data is not None else 0
            if group_bytes >= self._max_batch_bytes or len(group) >= self._max_batch_items:
                self._queue_puts(group, results, evicted)
                group, group_bytes = [], 0
        if group:
            self._queue_puts(group, results, evicted)
        self._notify_gone(evicted)
        return results

    def _queue_puts(
        self,
        group: list[tuple[bytes, bytes | None, int]],
        results: list[bool],
        evicted: list[bytes],
    ) -> None:
        with self._lock:
            for kb, data, created_ns in group:
                if data is None:
                    self._stats.dropped += 1
                    results.append(False)
                    continue
                self._wait_for_room_locked(len(data))
                self._check_writable()
                if kb in self._index:
                    self._used -= self._index.pop(kb)
                self._index[kb] = len(data)
                self._used += len(data)
                self._enqueue_locked(kb, _Op.PUT, data, created_ns=created_ns)
                self._stats.puts += 1
                evicted.extend(self._evict_to_budget_locked(keep=kb))
                results.append(True)

    def delete(self, key: BlockKey) -> bool:
        return self.delete_many([key]) == 1

    def delete_many(self, keys: Sequence[BlockKey]) -> int:
        self._check_writable()
        removed = 0
        with self._lock:
            self._check_writable()
            for key in keys:
                kb = key.to_bytes()
                size = self._index.pop(kb, None)
                if size is None:
                    continue
                self._used -= size
                self._touched.pop(kb, None)
                self._enqueue_locked(kb, _Op.DELETE, None)
                removed += 1
        return removed

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued before the call is committed (and fsynced)."""
        if self.readonly:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._check_writable()
            target = self._seq
            self._work.notify()
            while any(entry.first_seq <= target for entry in self._pending.values()):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._progress.wait(remaining)
        if not self.sync:
            self._env.sync(True)
        return True

    def close(self) -> None:
        """Commit everything pending, stop the writer and close the environment. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._work.notify()
        if self._writer is not None:
            self._writer.join()
            atexit.unregister(self.close)
        with self._lock:
            self._closed = True
            self._progress.notify_all()
        if self._env is not None and not self.readonly and not self.sync:
            self._env.sync(True)
        self._release()

    def _release(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        self._closing = self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.path}: the store is closed")

    def _check_writable(self) -> None:
        if self.readonly:
            raise StoreError(f"{self.path} is open read-only")
        if self._closing:
            raise StoreError(f"{self.path}: the store is closed")

    def _wait_for_room_locked(self, nbytes: int) -> None:
        """Backpressure: block while the pending puts would exceed ``max_pending_bytes``."""
        if threading.get_ident() == self._writer_ident:
            return  # an on_evict callback on the writer thread: waiting would deadlock
        while (
            self._pending_bytes
            and self._pending_bytes + nbytes > self._max_pending_bytes
            and not self._closing
        ):
            self._progress.wait()

    def _enqueue_locked(
        self, kb: bytes, op: _Op, data: bytes | None, *, reason: str = "", created_ns: int = 0
    ) -> _Pending:
        self._seq += 1
        seq = self._seq
        entry = self._pending.get(kb)
        if entry is None:
            entry = _Pending(op, data, reason, seq, seq, time.time_ns(), created_ns)
            self._pending[kb] = entry
            self._queue.append(kb)
        else:
            self._pending_bytes -= len(entry.data) if entry.data is not None else 0
            entry.op, entry.data, entry.reason, entry.seq = op, data, reason, seq
            entry.put_ns, entry.created_ns = time.time_ns(), created_ns
            if not entry.queued:  # the writer holds an older snapshot of it
                entry.queued = True
                if entry.next_first is None:
                    entry.next_first = seq
                self._queue.append(kb)
        self._pending_bytes += len(data) if data is not None else 0
        self._work.notify()
        return entry

    def _evict_to_budget_locked(self, keep: bytes | None = None) -> list[bytes]:
        evicted = []
        while self._used > self.capacity_bytes and self._index:
            victim = next(iter(self._index))
            if victim == keep:
                break
            self._used -= self._index.pop(victim)
            self._touched.pop(victim, None)
            self._enqueue_locked(victim, _Op.DELETE, None)
            self._stats.evictions += 1
            evicted.append(victim)
        return evicted

    def _notify_gone(self, gone: list[bytes]) -> None:
        if self._on_evict is None:
            return
        for kb in gone:
            try:
                self._on_evict(BlockKey.from_bytes(kb))
            except Exception:
                logger.exception("%s: on_evict callback failed", self.path)

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        self._writer_ident = threading.get_ident()
        next_reader_check = time.monotonic() + self._reader_check_interval
        next_touch_flush = time.monotonic() + self._access_flush_interval
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    now = time.monotonic()
                    if self._touched and now >= next_touch_flush:
                        break
                    if now >= next_reader_check:
                        break
                    wake = next_reader_check
                    if self._touched:
                        wake = min(wake, next_touch_flush)
                    self._work.wait(wake - now)
                snaps = self._take_batch_locked()
                touches: dict[bytes, int] = {}
                now = time.monotonic()
                if self._touched and (snaps or self._closing or now >= next_touch_flush):
                    touches, self._touched = self._touched, {}
                    next_touch_flush = now + self._access_flush_interval
                done = self._closing and not self._queue
            if snaps or touches:
                gone: list[bytes] = []
                try:
                    self._commit(snaps, touches, gone)
                except Exception:
                    logger.exception("%s: writer failed; dropping a batch", self.path)
                    self._abandon(snaps, gone)
                self._notify_gone(gone)
            if time.monotonic() >= next_reader_check:
                self._reclaim_readers()
                next_reader_check = time.monotonic() + self._reader_check_interval
            if done:
                return

    def _take_batch_locked(self) -> list[_Snap]:
        snaps: list[_Snap] = []
        nbytes = 0
        while self._queue and len(snaps) < self._max_batch_items:
            kb = self._queue[0]
            entry = self._pending.get(kb)
            if entry is None or not entry.queued:
                self._queue.popleft()  # a stale position: the key was taken or finished
                continue
            size = len(entry.data) if entry.data is not None else 0
            if snaps and nbytes + size > self._max_batch_bytes:
                break
            self._queue.popleft()
            snaps.append(self._snapshot_locked(kb, entry))
            nbytes += size
        return snaps

    @staticmethod
    def _snapshot_locked(kb: bytes, entry: _Pending) -> _Snap:
        entry.queued = False
        entry.next_first = None
        return _Snap(kb, entry.seq, entry.op, entry.data, entry.reason, entry.put_ns,
                     entry.created_ns)

    def _commit(self, snaps: list[_Snap], touches: dict[bytes, int], gone: list[bytes]) -> None:
        """Commit ``snaps``; on a full map or disk, evict more and retry, or drop.

        Keys that leave the store on the way are appended to ``gone``.
        """
        batch_keys = {s.key for s in snaps}
        work = [snaps]
        while work:
            part = work.pop()
            try:
                self._write_txn(part, touches)
            except (lmdb.MapFullError, lmdb.DiskError) as e:
                retry = self._make_room(part, batch_keys, e, gone)
                if retry is None:
                    touches = {}  # access times are a hint; give them up before records
                    if not any(s.op is _Op.PUT for s in part):
                        logger.error("%s: cannot commit even deletions (%s)", self.path, e)
                        self._abandon(part, gone)
                        continue
                    retry = self._shrink(part, gone)
                work.extend(reversed(retry))
                continue
            except lmdb.Error as e:
                logger.error("%s: commit failed (%s); dropping %d ops", self.path, e, len(part))
                self._abandon(part, gone)
                continue
            touches = {}
            self._finish(part)

    def _write_txn(self, snaps: list[_Snap], touches: dict[bytes, int]) -> None:
        records, meta = self._dbs[_DB_RECORDS], self._dbs[_DB_META]
        quarantine, info = self._dbs[_DB_QUARANTINE], self._dbs[_DB_INFO]
        used = self._disk_bytes
        with self._env.begin(write=True) as txn:
            for kb, access_ns in touches.items():
                old = txn.get(kb, db=meta)
                if old is not None:
                    _, size, created_ns = _META.unpack(old)
                    txn.put(kb, _META.pack(access_ns, size, created_ns), db=meta)
            # As few calls per key as possible: each one drops and retakes the GIL.
            for s in snaps:
                if s.op is _Op.PUT:
                    txn.put(s.key, s.data, db=records)
                    new = _META.pack(s.put_ns, len(s.data), s.created_ns)
                    used += len(s.data) - _meta_size(txn.replace(s.key, new, db=meta))
                    continue
                if s.op is _Op.QUARANTINE:
                    bad = txn.get(s.key, db=records)
                    if bad is not None:
                        txn.put(s.key, _pack_quarantine(s.reason, bad), db=quarantine)
                txn.delete(s.key, db=records)
                used -= _meta_size(txn.pop(s.key, db=meta))
            txn.put(_INFO_BYTES_USED, _U64.pack(used), db=info)
        self._disk_bytes = used

    def _make_room(
        self, part: list[_Snap], batch_keys: set[bytes], error: lmdb.Error, gone: list[bytes]
    ) -> list[list[_Snap]] | None:
        """Evict committed records in their own commit so ``part`` can be retried.

        Pages freed by a commit become reusable two commits later, so the eviction is
        followed by a small commit of its own before the retry.
        """
        self._reclaim_readers()
        need = sum(len(s.data) for s in part if s.op is _Op.PUT)
        need = max(need, min(self.capacity_bytes, self.map_size) // 10)
        with self._lock:
            victims: list[_Snap] = []
            freed = 0
            for kb in list(self._index):
                if freed >= need:
                    break
                if kb in batch_keys:
                    continue
                freed += self._index.pop(kb)
                self._touched.pop(kb, None)
                entry = self._enqueue_locked(kb, _Op.DELETE, None)
                victims.append(self._snapshot_locked(kb, entry))
            self._used -= freed
            self._stats.evictions += len(victims)
        if not victims:
            return None
        logger.warning(
            "%s: %s; evicting %d records (%d bytes) and retrying",
            self.path, type(error).__name__, len(victims), freed,
        )
        gone.extend(s.key for s in victims)
        try:
            self._write_txn(victims, {})
        except (lmdb.MapFullError, lmdb.DiskError):
            return [victims, part]  # retry the deletions first (they give up if hopeless)
        self._finish(victims)
        try:
            self._write_txn([], {})
        except (lmdb.MapFullError, lmdb.DiskError):
            pass  # the retry fails again and makes more room
        return [part]

    def _shrink(self, part: list[_Snap], gone: list[bytes]) -> list[list[_Snap]]:
        """Nothing left to evict: split a batch, or drop its one record that cannot fit."""
        puts = [s for s in part if s.op is _Op.PUT]
        if len(part) > 1:
            half = len(part) // 2
            return [part[:half], part[half:]]
        (s,) = puts
        with self._lock:
            entry = self._pending.get(s.key)
            self._stats.dropped += 1
            if entry is None or entry.seq != s.seq:
                self._finish_locked([s])
                return []
            logger.warning("%s: no room for %s even when empty; dropped", self.path, _short(s.key))
            self._pending_bytes -= len(entry.data)
            entry.op, entry.data = _Op.DELETE, None
            size = self._index.pop(s.key, None)
            if size is not None:
                self._used -= size
                gone.append(s.key)
            # The record replaced may still be committed: delete it instead.
            return [[s._replace(op=_Op.DELETE, data=None)]]

    def _finish(self, snaps: list[_Snap]) -> None:
        with self._lock:
            self._stats.bytes_written += sum(
                len(s.data) for s in snaps if s.op is _Op.PUT
            )
            self._finish_locked(snaps)

    def _finish_locked(self, snaps: list[_Snap]) -> None:
        for s in snaps:
            entry = self._pending.get(s.key)
            if entry is None:
                continue
            if entry.seq == s.seq:
                del self._pending[s.key]
                self._pending_bytes -= len(entry.data) if entry.data is not None else 0
            else:
                entry.first_seq = entry.next_first if entry.next_first is not None else entry.seq
        self._progress.notify_all()

    def _abandon(self, snaps: list[_Snap], gone: list[bytes]) -> None:
        """Give up on ``snaps`` after an I/O error: their puts are dropped, never half-done."""
        with self._lock:
            for s in snaps:
                entry = self._pending.get(s.key)
                if s.op is _Op.PUT and entry is not None and entry.seq == s.seq:
                    self._stats.dropped += 1
                    size = self._index.pop(s.key, None)
                    if size is not None:
                        self._used -= size
                        gone.append(s.key)
            self._finish_locked(snaps)

    def _reclaim_readers(self) -> None:
        stale = self._env.reader_check()
        if stale:
            logger.info("%s: reclaimed %d stale reader slots", self.path, stale)

    # ------------------------------------------------------------------ admin

    def quarantined(self) -> Iterator[QuarantineEntry]:
        """Records moved aside because they failed verification, with the reason."""
        self._check_open()
        last: bytes | None = None
        while True:
            batch: list[tuple[bytes, bytes]] = []
            with self._env.begin(db=self._dbs[_DB_QUARANTINE]) as txn:
                cursor = txn.cursor()
                more = cursor.set_range(last) if last is not None else cursor.first()
                if more and last is not None and cursor.key() == last:
                    more = cursor.next()
                while more and len(batch) < _KEYS_CHUNK:
                    batch.append(cursor.item())
                    more = cursor.next()
            for kb, value in batch:
                yield _unpack_quarantine(kb, value)
            if not more or not batch:
                return
            last = batch[-1][0]

    def clear_quarantine(self) -> int:
        """Forget every quarantined record; returns how many there were."""
        self._check_writable()
        self._check_open()
        with self._env.begin(write=True) as txn:
            count = txn.stat(self._dbs[_DB_QUARANTINE])["entries"]
            txn.drop(self._dbs[_DB_QUARANTINE], delete=False)
        return count

    def verify(self, progress: Callable[[int], None] | None = None) -> VerifyResult:
        """Read and check every committed record; quarantine the bad ones (when writable).

        ``progress(n)`` is called after every ``n`` records read.
        """
        checked = ok = nbytes = 0
        bad: list[tuple[bytes, RecordError]] = []
        for chunk in self._committed_key_chunks(None):
            for kb in chunk:
                with self._env.begin(db=self._dbs[_DB_RECORDS], buffers=True) as txn:
                    buf = txn.get(kb)
                    data = bytes(buf) if buf is not None else None
                if data is None:
                    continue  # removed since the chunk was listed
                checked += 1
                nbytes += len(data)
                try:
                    decode_record(data, expected_key=BlockKey.from_bytes(kb))
                    ok += 1
                except RecordError as e:
                    bad.append((kb, e))
                if progress is not None:
                    progress(1)
        with self._lock:
            gone = [kb for kb, error in bad if self._corrupt_locked(kb, error)]
        self._notify_gone(gone)
        if gone:
            self.flush()
        return VerifyResult(checked, ok, len(bad), len(gone), nbytes)

    def namespaces(self) -> list[bytes]:
        """The namespaces of committed records, in one read transaction (one seek each)."""
        self._check_open()
        found: list[bytes] = []
        with self._env.begin(db=self._dbs[_DB_RECORDS]) as txn:
            cursor = txn.cursor()
            more = cursor.first()
            while more:
                kb = cursor.key()
                if len(kb) != KEY_SIZE:
                    more = cursor.next()
                    continue
                namespace = kb[: KEY_SIZE // 2]
                found.append(namespace)
                after = int.from_bytes(namespace, "big") + 1
                if after >> (8 * len(namespace)):
                    break
                more = cursor.set_range(after.to_bytes(len(namespace), "big"))
        return found

    def metadata(self, namespace: bytes | None = None) -> Iterator[RecordMeta]:
        """Committed records' metadata in key order, each chunk from its own read transaction."""
        self._check_open()
        prefix = namespace or b""
        last: bytes | None = None
        while True:
            chunk: list[RecordMeta] = []
            with self._env.begin(db=self._dbs[_DB_META]) as txn:
                cursor = txn.cursor()
                more = cursor.set_range(last if last is not None else prefix)
                if more and last is not None and cursor.key() == last:
                    more = cursor.next()
                while more and len(chunk) < _KEYS_CHUNK:
                    kb, value = cursor.item()
                    if not kb.startswith(prefix):
                        more = False
                        break
                    last = kb
                    if len(kb) == KEY_SIZE and len(value) == _META.size:
                        chunk.append(RecordMeta(BlockKey.from_bytes(kb), *_META.unpack(value)))
                    more = cursor.next()
            yield from chunk
            if not more:
                return

    def raw_records(self, namespace: bytes | None = None) -> Iterator[tuple[BlockKey, bytes]]:
        """Committed records exactly as stored (not verified), one short read transaction each.

        For export and inspection: pending operations of this process are not seen.
        """
        self._check_open()
        for chunk in self._committed_key_chunks(namespace):
            for kb in chunk:
                with self._env.begin(db=self._dbs[_DB_RECORDS], buffers=True) as txn:
                    buf = txn.get(kb)
                    data = bytes(buf) if buf is not None else None
                if data is not None:
                    yield BlockKey.from_bytes(kb), data

    def copy_compacted(self, dest: str | os.PathLike[str]) -> None:
        """Write a compacted copy of the store (descriptor and data) into the new directory
        ``dest``, from one read snapshot; this store stays usable, and a writer may go on."""
        self._check_open()
        self.flush()
        dest = Path(dest)
        try:
            dest.mkdir(mode=0o700)
        except OSError as e:
            raise StoreError(f"cannot create {dest}: {e}") from None
        try:
            self.descriptor.save(dest)
            self._env.copy(str(dest), compact=True)
            _fsync_dir(dest)
        except (OSError, lmdb.Error) as e:
            for name in (DESCRIPTOR_NAME, "data.mdb"):  # what this call created, nothing else
                (dest / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                dest.rmdir()
            raise StoreError(f"cannot copy {self.path} to {dest}: {e}") from None

    def compact_and_close(self) -> None:
        """Replace the data file by a compacted copy, then close the store.

        Needs the writer lock (a store opened for writing) and no other process with the
        environment open: a reader would keep using the old file.
        """
        self._check_writable()
        others = self.info().reader_pids
        if others:
            raise StoreError(
                f"{self.path} is open in other processes (pids {', '.join(map(str, others))}); "
                "compacting in place needs it idle"
            )
        tmp = self.path / ".compact.tmp"
        if tmp.exists():
            for leftover in tmp.iterdir():
                leftover.unlink()
            tmp.rmdir()
        self.flush()
        with self._lock:
            self._closing = True
            self._work.notify()
        if self._writer is not None:
            self._writer.join()
            atexit.unregister(self.close)
        try:
            tmp.mkdir(mode=0o700)
            self._env.copy(str(tmp), compact=True)
            fd = os.open(tmp / "data.mdb", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._env.close()
            self._env = None
            os.replace(tmp / "data.mdb", self.path / "data.mdb")
            _fsync_dir(self.path)
            tmp.rmdir()
        except (OSError, lmdb.Error) as e:
            raise StoreError(f"cannot compact {self.path}: {e}") from None
        finally:
            with self._lock:
                self._closed = True
                self._progress.notify_all()
            self._release()

    def info(self) -> StoreInfo:
        """The descriptor and the environment's own figures."""
        self._check_open()
        stats = self.stats()
        env_info, env_stat = self._env.info(), self._env.stat()
        with self._env.begin() as txn:
            quarantined = txn.stat(self._dbs[_DB_QUARANTINE])["entries"]
        data_file = self.path / "data.mdb"
        readers = self._env.readers().splitlines()[1:]  # a header, then "pid thread txnid"
        return StoreInfo(
            path=str(self.path),
            readonly=self.readonly,
            descriptor=self.descriptor,
            entries=stats.entries,
            bytes_used=stats.bytes_used,
            quarantined=quarantined,
            data_file_bytes=data_file.stat().st_blocks * 512,
            map_size=env_info["map_size"],
            last_page=env_info["last_pgno"],
            page_size=env_stat["psize"],
            reader_pids=tuple(sorted({int(line.split()[0]) for line in readers} - {os.getpid()})),
        )


def _meta_size(value: bytes | None) -> int:
    return _META.unpack(value)[1] if value is not None else 0


def _pack_quarantine(reason: str, bad: bytes) -> bytes:
    why = reason.encode("utf-8", "replace")[:1024]
    return (
        _QUARANTINE_HEAD.pack(time.time_ns(), len(bad), len(why))
        + why
        + bytes(bad[:QUARANTINE_KEEP_BYTES])
    )


def _unpack_quarantine(kb: bytes, value: bytes) -> QuarantineEntry:
    when, size, why_len = _QUARANTINE_HEAD.unpack_from(value)
    start = _QUARANTINE_HEAD.size
    reason = value[start : start + why_len].decode("utf-8", "replace")
    return QuarantineEntry(
        BlockKey.from_bytes(kb), reason, when, size, bytes(value[start + why_len :])
    )


def _short(kb: bytes) -> str:
    return BlockKey.from_bytes(kb).short() if len(kb) == KEY_SIZE else kb.hex()[:20]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
