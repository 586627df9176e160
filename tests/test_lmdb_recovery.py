"""The LMDB store on a full or failing disk, and the modes and places of its files: what
fails is degraded with one warning, repairs change nothing they cannot finish."""
from __future__ import annotations

import errno
import logging
import time
import os
import stat
from pathlib import Path

import pytest

from storage.base import BlockKey, StoreError
from storage.lmdb_store import (
    DESCRIPTOR_NAME,
    LmdbStore,
)
from storage.seal import KEY_FILE_NAME

from lmdb_testing import FailingDisk, disk_error, key, put, record, same
from lmdb_testing import path  # noqa: F401  (a fixture)


# ---------------------------------------------------------------- a full or failing disk


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_full_disk_evicts_and_retries(path: Path, monkeypatch, caplog, code: int) -> None:
    caplog.set_level(logging.INFO, logger="storage")
    evicted: list[BlockKey] = []
    with LmdbStore(path, 16 << 20, on_evict=evicted.append) as store:
        disk = FailingDisk(store, monkeypatch, disk_error(code), room=200_000)
        for i in range(60):
            put(store, i, size=10_000)
            if i % 5 == 4:
                assert store.flush(timeout=10)
        assert disk.failed and evicted and store.stats().evictions == len(evicted)
        assert not store.degraded and store.stats().dropped == 0
        assert store.stats().bytes_used <= 200_000
        assert all(same(store.get(key(i)), record(i, 10_000)) for i in range(55, 60))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with LmdbStore(path, 16 << 20) as store:
        assert sorted(store.keys()) == sorted(key(i) for i in range(60) if key(i) not in evicted)


def test_flush_returns_once_on_evict_heard_of_the_evictions(path: Path, monkeypatch) -> None:
    """The writer calls ``on_evict`` after its commit; a flush that returned in between
    left a caller counting evictions ``on_evict`` had not reported yet."""
    evicted: list[BlockKey] = []

    def slow(k: BlockKey) -> None:
        time.sleep(0.02)
        evicted.append(k)

    with LmdbStore(path, 16 << 20, on_evict=slow) as store:
        FailingDisk(store, monkeypatch, disk_error(errno.ENOSPC), room=200_000)
        for i in range(40):
            put(store, i, size=10_000)
            if i % 5 == 4:
                assert store.flush(timeout=10)
                assert store.stats().evictions == len(evicted)
        assert evicted


def test_failing_disk_degrades_the_store_with_one_warning(
    path: Path, monkeypatch, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="storage")
    gone: list[BlockKey] = []
    with LmdbStore(path, 16 << 20, on_evict=gone.append) as store:
        for i in range(5):
            put(store, i)
        assert store.flush() and not store.degraded
        disk = FailingDisk(store, monkeypatch, disk_error(errno.EIO), room=None)
        for i in range(5, 45):
            put(store, i)
            if i % 10 == 4:
                assert store.flush(timeout=10) is False  # what it was asked to keep is lost
        assert store.flush(timeout=10)  # nothing more was lost since
        stats = store.stats()
        assert store.degraded and stats.write_errors >= 4 and stats.dropped == 40
        assert sorted(gone) == sorted(key(i) for i in range(5, 45))
        # The evictions tried to make room failed too, and were undone.
        assert stats.evictions == 0
        assert all(same(store.get(key(i)), record(i)) for i in range(5))
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "degraded" in warnings[0].getMessage()

        disk.room = 1 << 30  # the disk has room again
        put(store, 99)
        assert store.flush(timeout=10) and not store.degraded
        assert same(store.get(key(99)), record(99))
    with LmdbStore(path, 16 << 20) as store:
        assert sorted(store.keys()) == sorted([key(i) for i in range(5)] + [key(99)])


# ---------------------------------------------------------------- file modes


def test_an_existing_store_directory_is_made_private(path: Path, tmp_path: Path) -> None:
    LmdbStore(path, 1 << 20).close()
    os.chmod(path, 0o755)
    with LmdbStore(path, readonly=True) as store:  # a reader changes nothing
        store.stats()
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    with LmdbStore(path, None) as store:
        put(store, 1)
        store.flush()
        store.copy_compacted(tmp_path / "copy")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for name in ("data.mdb", DESCRIPTOR_NAME, KEY_FILE_NAME):
        assert stat.S_IMODE((tmp_path / "copy" / name).stat().st_mode) == 0o600, name
    with LmdbStore(tmp_path / "copy", readonly=True) as copy:  # the copy verifies: same key
        assert same(copy.get(key(1)), record(1))
    LmdbStore(path, None).compact_and_close()
    assert stat.S_IMODE((path / "data.mdb").stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_store_directory_of_another_user_is_left_alone_with_one_warning(
    path: Path, caplog
) -> None:
    LmdbStore(path, 1 << 20).close()
    os.chmod(path, 0o750)
    os.chown(path, 65534, -1)
    with LmdbStore(path, None) as store:
        put(store, 1)
        store.flush()
    assert stat.S_IMODE(path.stat().st_mode) == 0o750
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "0700" in warnings[0].getMessage()


# ---------------------------------------------------------------- repairs on a failing disk


def on_a_failing_disk(target: Path, monkeypatch) -> None:
    """A store opened at ``target`` from now on fails every commit with EIO."""
    init = LmdbStore.__init__

    def failing(self, where, *args, **kwargs):
        init(self, where, *args, **kwargs)
        if Path(where) == target:
            FailingDisk(self, monkeypatch, disk_error(errno.EIO), room=None)

    monkeypatch.setattr(LmdbStore, "__init__", failing)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_repair_onto_a_failing_disk_fails_and_changes_nothing(path: Path, tmp_path: Path, monkeypatch, in_place) -> None:
    """Salvaged records the fresh store cannot commit make the repair fail: it never reports
    them salvaged, nor swaps a short store in for the source."""
    with LmdbStore(path, 16 << 20) as store:
        for i in range(20):
            put(store, i, size=200)
    target = path.with_name(f"{path.name}.repairing") if in_place else tmp_path / "fixed"
    on_a_failing_disk(target, monkeypatch)
    with pytest.raises(StoreError, match="20 salvaged records could not be written"):
        LmdbStore.repair(path, None if in_place else target)
    monkeypatch.undo()
    assert not target.exists() and not list(path.parent.glob(f"{path.name}.damaged-*"))
    with LmdbStore(path, 16 << 20) as store:
        assert sorted(store.keys()) == sorted(key(i) for i in range(20))


def test_a_repair_in_place_clears_what_a_killed_repair_left(path: Path) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(5):
            put(store, i, size=200)
    leftover = path.with_name(f"{path.name}.repairing")  # a half-built fresh store
    leftover.mkdir()
    (leftover / "data.mdb").write_bytes(b"half")
    result = LmdbStore.repair(path)
    assert result.salvaged == 5 and not leftover.exists()
    with LmdbStore(path, 16 << 20) as store:
        assert sorted(store.keys()) == sorted(key(i) for i in range(5))


def test_a_delete_given_up_on_a_failing_disk_makes_the_flush_false(path: Path, monkeypatch) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(4):
            put(store, i, size=200)
        assert store.flush()
        FailingDisk(store, monkeypatch, disk_error(errno.EIO), room=None)
        assert store.delete_many([key(0), key(1)]) == 2
        assert not store.flush()  # the deletions did not happen: not a success
        monkeypatch.undo()
        assert store.flush()


def test_a_failed_repair_counts_as_lost_only_the_records_the_fresh_store_takes(
    path: Path, tmp_path: Path, monkeypatch
) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(20):
            put(store, i, size=200)
        for i in range(20, 22):
            put(store, i, size=200_000)  # larger than the fresh store below takes
    target = tmp_path / "fixed"
    on_a_failing_disk(target, monkeypatch)
    with pytest.raises(StoreError, match="^[^:]*: 20 salvaged records could not be written"):
        LmdbStore.repair(path, target, capacity_bytes=128 << 10)
