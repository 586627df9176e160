"""Repair of a damaged disk store: its readable records salvaged into a fresh one.

:class:`Repair` is a part of :class:`storage.lmdb_store.LmdbStore`: :meth:`Repair.repair`
works on a directory whose data file LMDB must not map (it reads it with
:mod:`storage.lmdb_salvage`), and opens the fresh store as an ``LmdbStore``.
"""
from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from storage.base import KEY_SIZE, BlockKey, StoreError
from storage.lmdb_directory import fresh_place, lock_writer, replace_aside, store_key
from storage.lmdb_descriptor import StoreDescriptor
from storage.lmdb_layout import DATA_NAME, DB_META, DB_RECORDS, DESCRIPTOR_NAME
from storage.lmdb_meta import unpack_meta
from storage.lmdb_salvage import Found, salvage
from storage.priority_lru import DEFAULT_PRIORITY
from storage.record import MAGIC, Record, RecordError, decode_record
from storage.seal import SealKey

if TYPE_CHECKING:
    from storage.lmdb_store import LmdbStore

logger = logging.getLogger(__name__)

_REPAIR_BATCH = 256  # records per put_many: one writer transaction each


class RepairResult(NamedTuple):
    """What :meth:`Repair.repair` salvaged."""

    output: Path  # the repaired store
    moved_aside: Path | None  # where the damaged store went (a repair in place)
    salvaged: int
    skipped: int  # found, but unreadable, failing verification, or larger than the budget
    evicted: int  # salvaged, then evicted (or refused) to fit the budget
    problems: tuple[str, ...]  # what could not be read (the first hundred)


class Repair:
    """Repair of a damaged store (a part of :class:`~storage.lmdb_store.LmdbStore`; see the
    module docstring)."""

    @classmethod
    def repair(
        cls,
        source: str | os.PathLike[str],
        dest: str | os.PathLike[str] | None = None,
        *,
        capacity_bytes: int | None = None,
        progress: Callable[[int], None] | None = None,
        expected: Callable[[int | None], None] | None = None,
    ) -> RepairResult:
        """Salvage the readable records of a (damaged) store into a fresh one.

        ``source``'s data file is read page by page with ``pread``, never mapped (see
        :class:`storage.lmdb_salvage.Salvage`); every record found is checked against its key
        and the seal of ``source``'s key, and what cannot be read or fails is skipped; the
        rest is re-sealed under the fresh store's own new key, each record at the priority
        ``source``'s ``meta`` db still gives it (the default, 0, where that cannot be read:
        a smaller budget keeps the records that matter most). ``dest`` must be missing
        or empty; without it the repair is in place: the fresh store is built beside
        ``source`` (inside it, if it is a mount point), which is then moved to
        ``<source>.damaged-<time>`` (its files, into it) and replaced. The
        fresh store's budget is ``capacity_bytes``, or the one ``source`` records.
        ``expected(n)`` is told how many records the source claims (``None`` if unknown),
        ``progress(1)`` each one read. Needs ``source``'s writer lock: no server may hold it;
        except on a read-only filesystem (a failing disk mounted read-only to rescue it),
        where no one can write ``source`` and ``dest`` is the only place to repair into.
        """
        source = Path(source)
        if not (source / DESCRIPTOR_NAME).exists() or not (source / DATA_NAME).exists():
            raise StoreError(f"{source} is not a tiered-kv disk store with data to repair")
        if os.statvfs(source).f_flag & os.ST_RDONLY:
            if dest is None:
                raise StoreError(
                    f"{source} is on a read-only filesystem: it can be repaired into another "
                    f"directory only (`tiered-kv storage repair {source} --out DIR2`)"
                )
            lock_fd = None  # no one can write it
        else:
            lock_fd = lock_writer(source)
        try:
            source_key = store_key(source, create=False)
            if capacity_bytes is None:
                try:
                    capacity_bytes = StoreDescriptor.load(source).capacity_bytes
                except StoreError as e:
                    raise StoreError(f"{e}; give the new store's size") from None
            target = fresh_place(source) if dest is None else Path(dest)
            if dest is None and target.exists():  # a repair killed midway: we hold the lock
                logger.warning("%s: removing what a repair cut short left", target)
                shutil.rmtree(target)
            if target.exists() and (not target.is_dir() or any(target.iterdir())):
                raise StoreError(f"{target} exists and is not empty; repair writes a new store")
            try:
                priorities = _salvage_priorities(source)
                with salvage(source, DB_RECORDS) as found:
                    with cls(target, capacity_bytes, sync=False) as fresh:
                        if expected is not None:
                            expected(found.expected)
                        copied = _copy_verified(
                            found.entries(), source_key, priorities, fresh, progress
                        )
                        flushed = fresh.flush()  # False: commits failed, records were lost
                        stats = fresh.stats()
                        if not flushed:  # a full or failing disk
                            lost = stats.dropped - copied.refused - copied.oversized
                            raise StoreError(
                                f"{target}: {lost} salvaged records could not be written (a full "
                                "or failing disk?); nothing was changed: the source is as it was"
                            )
                        evicted = stats.evictions + copied.refused
            except BaseException:
                shutil.rmtree(target, ignore_errors=True)  # what this call created
                raise
            moved = None
            if dest is None:
                moved = replace_aside(source, target)
                target = source
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        return RepairResult(
            target, moved, copied.salvaged, copied.skipped, evicted, tuple(found.problems)
        )


def _salvage_priorities(source: Path) -> dict[bytes, int]:
    """Each key's priority as ``source``'s ``meta`` db still gives it, read like the
    records (:func:`salvage`); the first value found for a key wins. A key missing here
    gets the default priority: damaged metadata costs order, never records."""
    priorities: dict[bytes, int] = {}
    with salvage(source, DB_META) as found:
        for kb, value, _ in found.entries():
            meta = unpack_meta(value) if value is not None and len(kb) == KEY_SIZE else None
            if meta is not None and kb not in priorities:
                priorities[kb] = meta.priority
    return priorities


class _Copied(NamedTuple):
    salvaged: int
    skipped: int  # keys for which no good record fitted the fresh store
    refused: int  # salvaged, but refused: only records that matter more could make room
    oversized: int  # salvaged, but larger than the fresh store takes (among the skipped)


def _copy_verified(
    entries: Iterator[Found], source_key: SealKey, priorities: dict[bytes, int],
    fresh: LmdbStore, progress: Callable[[int], None] | None,
) -> _Copied:
    """Put the first good record found for each key into ``fresh`` at its priority."""
    salvaged: set[bytes] = set()
    failed: set[bytes] = set()
    refused = oversized = 0
    batch: list[_Salvaged] = []
    for kb, value, scanned in entries:
        if progress is not None:
            progress(1)
        if kb in salvaged or scanned and (value is None or not value.startswith(MAGIC)):
            continue  # had already, or (found by scanning) an entry of another db
        try:
            key = BlockKey.from_bytes(kb)  # a damaged page can hold a key of any length
            record = decode_record(value or b"", source_key, key, parallel_mac=True)
        except (ValueError, RecordError):
            failed.add(kb)
            continue
        batch.append(_Salvaged(key, record, priorities.get(kb, DEFAULT_PRIORITY), len(value)))
        salvaged.add(kb)
        if len(batch) >= _REPAIR_BATCH:
            counts = _put(fresh, batch, salvaged, failed)
            refused, oversized, batch = refused + counts[0], oversized + counts[1], []
    counts = _put(fresh, batch, salvaged, failed)
    return _Copied(len(salvaged), len(failed - salvaged), refused + counts[0], oversized + counts[1])


class _Salvaged(NamedTuple):
    key: BlockKey
    record: Record
    priority: int
    nbytes: int  # as sealed under the source's key: the same size under the fresh one


def _put(
    fresh: LmdbStore, batch: list[_Salvaged], salvaged: set[bytes], failed: set[bytes]
) -> tuple[int, int]:
    """Put ``batch``; how many were refused for want of room that mattered less, and how
    many were larger than ``fresh`` takes."""
    accepted = fresh.put_many(
        [(s.key, s.record) for s in batch], priorities=[s.priority for s in batch]
    )
    refused = oversized = 0
    for s, ok in zip(batch, accepted):
        if ok:
            continue
        if s.nbytes <= fresh.max_record_bytes:
            refused += 1
            continue
        salvaged.discard(s.key.to_bytes())  # larger than the fresh store takes
        failed.add(s.key.to_bytes())
        oversized += 1
    return refused, oversized
