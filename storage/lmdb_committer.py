"""The disk tier's committer: pending operations and the writer thread that commits them.

``put`` and ``delete`` never touch LMDB: they record the newest operation on each key in a
map of *pending* operations and wake the writer thread, which takes up to one batch
(``max_batch_items`` keys, ``max_batch_bytes``), writes it with the batched access times
in one write transaction, commits, and retires the entries no newer operation replaced.

:class:`Committer` is a part of :class:`storage.lmdb_store.LmdbStore`: it uses the store's
lock and conditions (``_lock``, ``_work``, ``_progress``), its index (``_index``,
``_used``, ``_touched``), its counters (``_stats``), ``_env`` and ``_dbs``. A failed
commit goes to :class:`storage.lmdb_recovery.Recovery`.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import struct
import threading
import time
from collections.abc import Sequence

import lmdb

from storage.base import KEY_SIZE, BlockKey
from storage.lmdb_layout import (
    DB_INFO, DB_META, DB_QUARANTINE, DB_RECORDS, INFO_BYTES_USED, U64,
)
from storage.lmdb_meta import META, NO_PARENT, meta_size, pack_meta, unpack_meta
from storage.priority_lru import DEFAULT_PRIORITY

logger = logging.getLogger("storage.lmdb_store")

QUARANTINE_HEAD = struct.Struct("<QQH")  # quarantined ns, original size, reason length
# Enough of a bad record to read its header (key, shape, codec, token ids) offline.
QUARANTINE_KEEP_BYTES = 4096


class Op(enum.Enum):
    PUT = "put"
    DELETE = "delete"
    QUARANTINE = "quarantine"


@dataclasses.dataclass(slots=True)
class Pending:
    """The newest not-yet-committed operation on one key.

    ``seq`` numbers the latest change; ``first_seq`` the oldest change not yet covered by a
    commit (what ``flush`` waits for). The writer commits an entry as it is when it takes
    it (``queued`` false): a change meanwhile makes a new entry in its place, which goes
    to ``next_first`` and re-queues the key.
    """

    key: bytes
    op: Op
    data: bytes | memoryview | None  # an encoded record (storage.record.encode_record_buffer)
    reason: str
    seq: int
    first_seq: int
    put_ns: int  # the access time to store: the put's, or a read's while queued (lmdb_reader)
    created_ns: int
    priority: int
    parent: bytes | None  # the record's parent hash, stored with its metadata
    queued: bool = True
    next_first: int | None = None


class Committer:
    """Pending operations, the writer thread and its write transactions (a part of
    :class:`~storage.lmdb_store.LmdbStore`; see the module docstring)."""

    def _init_committer(self) -> None:
        self._pending: dict[bytes, Pending] = {}
        self._queue: collections.deque[bytes] = collections.deque()
        self._pending_bytes = 0
        self._seq = 0
        self._lost = 0  # accepted changes that were never committed
        self._lost_reported = 0  # ... as of the last flush
        self._writer: threading.Thread | None = None
        self._writer_ident: int | None = None
        self._disk_bytes = 0  # committed bytes as the writer thread knows them

    def _start_writer(self) -> None:
        self._writer = threading.Thread(
            target=self._run, name=f"lmdb-writer:{self.path.name}", daemon=True
        )
        self._writer.start()

    def _stop_writer(self) -> None:
        """Commit what is pending and join the writer thread; no put is taken after."""
        with self._lock:
            self._closing = True
            self._work.notify()
        if self._writer is not None:
            self._writer.join()

    # ------------------------------------------------------------------ pending operations

    def _enqueue_locked(
        self, kb: bytes, op: Op, data: bytes | memoryview | None, *, reason: str = "",
        created_ns: int = 0,
        priority: int = DEFAULT_PRIORITY,
        parent: bytes | None = None,
    ) -> Pending:
        """Record ``op`` as ``kb``'s newest pending operation. A caller other than the writer
        thread wakes the writer (``_work.notify()``) once it has queued all it queues under
        this hold of the lock: the writer cannot take any of it before the lock is let go."""
        self._seq += 1
        seq = self._seq
        entry = self._pending.get(kb)
        if entry is None:
            entry = Pending(
                kb, op, data, reason, seq, seq, time.time_ns(), created_ns, priority, parent
            )
            self._pending[kb] = entry
            self._queue.append(kb)
        elif entry.queued:
            self._pending_bytes -= len(entry.data) if entry.data is not None else 0
            entry.op, entry.data, entry.reason, entry.seq = op, data, reason, seq
            entry.put_ns, entry.created_ns = time.time_ns(), created_ns
            entry.priority, entry.parent = priority, parent
        else:  # the writer is committing the entry as it was: a new one takes its place
            self._pending_bytes -= len(entry.data) if entry.data is not None else 0
            entry = Pending(kb, op, data, reason, seq, entry.first_seq, time.time_ns(),
                            created_ns, priority, parent, next_first=seq)
            self._pending[kb] = entry
            self._queue.append(kb)
        self._pending_bytes += len(data) if data is not None else 0
        return entry

    def _enqueue_puts_locked(
        self, kbs: list[bytes], datas: list[bytes | memoryview], created: list[int],
        priorities: list[int], parents: Sequence[bytes | None],
    ) -> None:
        """:meth:`_enqueue_locked` of a put of each key, in order (the caller wakes the
        writer as there)."""
        pending, queue, put = self._pending, self._queue, Op.PUT
        now = time.time_ns()
        added = 0
        for kb, data, created_ns, priority, parent in zip(kbs, datas, created, priorities, parents):
            if kb in pending:  # put again before its last change was committed
                entry = self._enqueue_locked(kb, put, data, created_ns=created_ns,
                                             priority=priority, parent=parent)
                entry.put_ns = now  # the call's one access time: no later than the keys after it
                continue
            self._seq = seq = self._seq + 1
            pending[kb] = Pending(kb, put, data, "", seq, seq, now, created_ns, priority, parent)
            queue.append(kb)
            added += len(data)
        self._pending_bytes += added

    def _wait_for_room_locked(self, nbytes: int) -> None:
        """Backpressure: block while the pending puts would exceed ``max_pending_bytes``."""
        if threading.get_ident() == self._writer_ident:
            return  # an on_evict callback on the writer thread: waiting would deadlock
        while (
            self._pending_bytes
            and self._pending_bytes + nbytes > self._max_pending_bytes
            and not self._closing
        ):
            self._work.notify()  # for what the caller queued so far under this hold
            self._progress.wait()

    def _wait_committed_locked(self, target: int, deadline: float | None) -> bool:
        """Wait until every change numbered ``target`` or lower is committed or given up,
        and ``on_evict`` has been called for the keys the batch under way made leave (the
        writer calls it after the commit)."""
        self._work.notify()
        # (an on_evict callback that flushes runs on the writer: it cannot wait for itself)
        notifying = threading.get_ident() != self._writer_ident
        while (notifying and self._notifying) or any(
            entry.first_seq <= target for entry in self._pending.values()
        ):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._progress.wait(remaining)
        return True

    def _take_lost_locked(self) -> int:
        """Accepted puts given up since the last call (what ``flush`` reports)."""
        lost = self._lost - self._lost_reported
        self._lost_reported = self._lost
        return lost

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
                self._notifying = bool(snaps or touches)
            if snaps or touches:
                gone: list[bytes] = []
                try:
                    self._commit(snaps, touches, gone)
                except Exception:
                    logger.exception("%s: writer failed; dropping a batch", self.path)
                    self._abandon(snaps, gone)
                try:
                    self._notify_gone(gone)
                finally:
                    with self._lock:  # a flush returns once on_evict heard of the batch's leavers
                        self._notifying = False
                        self._progress.notify_all()
            if time.monotonic() >= next_reader_check:
                self._reclaim_readers()
                next_reader_check = time.monotonic() + self._reader_check_interval
            if done:
                return

    def _take_batch_locked(self) -> list[Pending]:
        queue, pending = self._queue, self._pending
        max_items, max_bytes = self._max_batch_items, self._max_batch_bytes
        snaps: list[Pending] = []
        nbytes = 0
        while queue and len(snaps) < max_items:
            entry = pending.get(queue[0])
            if entry is None or not entry.queued:
                queue.popleft()  # a stale position: the key was taken or finished
                continue
            size = len(entry.data) if entry.data is not None else 0
            if snaps and nbytes + size > max_bytes:
                break
            queue.popleft()
            snaps.append(self._take_locked(entry))
            nbytes += size
        return snaps

    @staticmethod
    def _take_locked(entry: Pending) -> Pending:
        """The writer takes ``entry`` to commit it as it is (see :class:`Pending`)."""
        entry.queued = False
        entry.next_first = None
        return entry

    def _commit(self, snaps: list[Pending], touches: dict[bytes, int], gone: list[bytes]) -> None:
        """Commit ``snaps``; a failed commit is recovered from, or its puts dropped.

        Keys that leave the store on the way are appended to ``gone``.
        """
        batch_keys = {s.key for s in snaps}
        work = [snaps]
        while work:
            part = work.pop()
            try:
                self._write_txn(part, touches)
            except lmdb.MapFullError as e:
                touches = {}
                work.extend(reversed(self._recover_map_full(part, batch_keys, e, gone)))
                continue
            except lmdb.Error as e:
                touches = {}  # access times are a hint; give them up before records
                if not self._recover_write_error(part, batch_keys, e, gone):
                    self._abandon(part, gone)
                continue
            touches = {}
            self._wrote(part)

    def _write_txn(self, snaps: list[Pending], touches: dict[bytes, int]) -> None:
        records, meta = self._dbs[DB_RECORDS], self._dbs[DB_META]
        quarantine, info = self._dbs[DB_QUARANTINE], self._dbs[DB_INFO]
        used = self._disk_bytes
        with self._env.begin(write=True) as txn:
            for kb, access_ns in touches.items():
                old = txn.get(kb, db=meta)
                known = unpack_meta(old) if old is not None else None
                if known is not None:
                    new = pack_meta(access_ns, known.nbytes, known.created_ns, known.priority,
                                    known.parent_hash)
                    txn.put(kb, new, db=meta)
            # The puts as three calls, not a few a key: each call drops and retakes the GIL,
            # and parses its arguments holding it. A batch holds a key once.
            put = Op.PUT  # bound once: an enum's member is looked up through its class's hook
            puts = [s for s in snaps if s.op is put]
            if puts:
                txn.cursor(db=records).putmulti([(s.key, s.data) for s in puts])
                replaced = txn.cursor(db=meta).getmulti([s.key for s in puts])
                pack, none = META.pack, NO_PARENT
                txn.cursor(db=meta).putmulti([
                    (s.key, pack(s.put_ns, len(s.data), s.created_ns, s.priority, s.parent or none))
                    for s in puts
                ])
                used += sum([len(s.data) for s in puts]) - sum([meta_size(v) for _, v in replaced])
            for s in snaps:
                if s.op is put:
                    continue
                if s.op is Op.QUARANTINE:
                    bad = txn.get(s.key, db=records)
                    if bad is not None:
                        txn.put(s.key, pack_quarantine(s.reason, bad), db=quarantine)
                txn.delete(s.key, db=records)
                used -= meta_size(txn.pop(s.key, db=meta))
            txn.put(INFO_BYTES_USED, U64.pack(used), db=info)
        self._disk_bytes = used

    def _wrote(self, snaps: list[Pending]) -> None:
        """``snaps`` are committed: count them and retire their pending entries."""
        with self._lock:
            put = Op.PUT
            written = sum([len(s.data) for s in snaps if s.op is put])
            if written:
                self._stats.bytes_written += written
                self._writes_resumed_locked()
            self._finish_locked(snaps)

    def _finish_locked(self, snaps: list[Pending]) -> None:
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

    def _abandon(self, snaps: list[Pending], gone: list[bytes]) -> None:
        """Give up on ``snaps`` after a failed commit: their puts are dropped, never
        half-done, and every change given up (a put, a delete, a quarantine) is counted for
        the next ``flush`` to report."""
        with self._lock:
            for s in snaps:
                entry = self._pending.get(s.key)
                if entry is None or entry.seq != s.seq:
                    continue  # changed again since: the newer change stands
                self._lost += 1
                if s.op is Op.PUT:
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


def short_key(kb: bytes) -> str:
    return BlockKey.from_bytes(kb).short() if len(kb) == KEY_SIZE else kb.hex()[:20]


def pack_quarantine(reason: str, bad: bytes) -> bytes:
    why = reason.encode("utf-8", "replace")[:1024]
    return (
        QUARANTINE_HEAD.pack(time.time_ns(), len(bad), len(why))
        + why
        + bytes(bad[:QUARANTINE_KEEP_BYTES])
    )
