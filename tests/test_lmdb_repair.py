"""Repairing a damaged LMDB store: salvaging what can be read, and moving the damaged store
aside (also on a mount point or a read-only filesystem)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from storage.base import StoreError
from storage.lmdb_store import (
    LmdbStore,
)

from lmdb_testing import key, put, record, same, truncate_to
from lmdb_testing import path  # noqa: F401  (a fixture)


# ---------------------------------------------------------------- salvage


def test_repair_scans_the_pages_when_no_meta_page_is_left(path: Path, tmp_path: Path) -> None:
    sizes = {i: 200 if i % 3 else 9000 for i in range(50)}  # inline and overflow values
    with LmdbStore(path, 16 << 20) as store:
        for i, size in sizes.items():
            put(store, i, size=size)
    data = bytearray((path / "data.mdb").read_bytes())
    data[data.find(record(6, 9000).payload) + 100] ^= 1  # rot in place: no good copy left
    data[16:20] = data[4096 + 16 : 4096 + 20] = bytes(4)  # both meta pages' magic numbers
    (path / "data.mdb").write_bytes(bytes(data))
    result = LmdbStore.repair(path, tmp_path / "fixed")
    assert (result.salvaged, result.skipped, result.moved_aside) == (49, 1, None)
    assert any("scanning" in problem for problem in result.problems)
    with LmdbStore(tmp_path / "fixed", readonly=True) as fixed:
        assert all(same(fixed.get(key(i)), record(i, size)) for i, size in sizes.items() if i != 6)
        assert fixed.stats().entries == 49


def test_repair_skips_an_entry_whose_key_is_not_a_block_key(path: Path, tmp_path: Path, monkeypatch) -> None:
    """A damaged page can yield a key of any length: the entry is skipped, never a crash."""
    from storage import lmdb_salvage
    from storage.record import MAGIC

    with LmdbStore(path, 16 << 20) as store:
        for i in range(5):
            put(store, i, size=200)
    entries = lmdb_salvage.Salvage.entries

    def with_a_bad_key(self):
        yield lmdb_salvage.Found(b"\x01" * 40, MAGIC + bytes(100), False)
        yield from entries(self)

    monkeypatch.setattr(lmdb_salvage.Salvage, "entries", with_a_bad_key)
    result = LmdbStore.repair(path, tmp_path / "fixed")
    assert (result.salvaged, result.skipped) == (5, 1)


# ---------------------------------------------------------------- moving a damaged store aside


def test_verify_reads_a_record_whose_key_bytes_were_damaged(path: Path) -> None:
    """A flipped byte in a stored key puts it out of LMDB's order: lookups no longer find it
    (nor, maybe, its neighbours), but verify reads every record where the cursor stands,
    so the damaged one fails its key check, and the structure check names the order."""
    from storage.lmdb_file import check_structure

    with LmdbStore(path, 16 << 20) as store:
        for i in range(8):
            put(store, i, size=200)
    victim = sorted(key(i).to_bytes() for i in range(8))[3]
    data = bytearray((path / "data.mdb").read_bytes())
    at = data.find(victim)
    assert at >= 0
    while at >= 0:  # in the records db and the meta db
        data[at + 32] ^= 0xFF  # the block hash's first byte: the key sorts elsewhere
        at = data.find(victim, at + 1)
    (path / "data.mdb").write_bytes(bytes(data))
    assert any("out of order" in p for p in check_structure(path).problems)
    with LmdbStore(path, readonly=True) as store:
        result = store.verify()
    assert result.checked == 8 and result.corrupt == 1 and result.ok == 7


def test_the_structure_check_is_not_fooled_by_a_writer_growing_the_file(path: Path, monkeypatch) -> None:
    """A writer that commits and grows data.mdb during the walk is a reason to walk again,
    never "damaged: truncated" (the meta pages read against the file's old size)."""
    from storage import lmdb_file

    walk, walks = lmdb_file._walk_all, []
    with LmdbStore(path, 64 << 20) as store:
        put(store, 0)
        assert store.flush()
        size = (path / "data.mdb").stat().st_size

        def walk_while_a_writer_commits(file, meta):
            check = walk(file, meta)
            walks.append(meta.txnid)
            if len(walks) == 1:
                for i in range(1, 40):
                    put(store, i, size=100_000)
                assert store.flush()
                assert (path / "data.mdb").stat().st_size > size
            return check

        monkeypatch.setattr(lmdb_file, "_walk_all", walk_while_a_writer_commits)
        assert lmdb_file.check_structure(path) == ([], (0, ()))
    assert len(walks) == 2 and walks[1] > walks[0]


@pytest.mark.parametrize("swap", [True, False])
def test_replacing_a_store_puts_the_old_one_aside(tmp_path: Path, monkeypatch, swap) -> None:
    """In place, a repair swaps the fresh store in (in one step where the filesystem can,
    else in two renames); the old one is kept whole beside it."""
    from storage import lmdb_directory

    old, fresh = tmp_path / "kv", tmp_path / "kv.repairing"
    for where, text in ((old, "old"), (fresh, "fresh")):
        where.mkdir()
        (where / "mark").write_text(text)
    if not swap:
        monkeypatch.setattr(lmdb_directory, "_exchange", lambda a, b: False)
    aside = lmdb_directory.replace_aside(old, fresh)
    assert (old / "mark").read_text() == "fresh" and (aside / "mark").read_text() == "old"
    assert aside.name.startswith("kv.damaged-") and not fresh.exists()


def mount_point(path: Path, monkeypatch) -> None:
    """Make ``path`` behave as a mount point: it cannot be renamed (EBUSY)."""
    from storage import lmdb_directory

    rename, ismount = os.rename, os.path.ismount

    def pinned(source, dest, *args, **kwargs):
        if Path(source) == path:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(source))
        return rename(source, dest, *args, **kwargs)

    monkeypatch.setattr(lmdb_directory.os, "rename", pinned)
    monkeypatch.setattr(lmdb_directory.os.path, "ismount", lambda p: Path(p) == path or ismount(p))


def test_a_damaged_store_on_a_mount_point_is_moved_aside_inside_it(path: Path, monkeypatch) -> None:
    """Compose mounts a volume at the store directory, which cannot be renamed: its files
    go aside into a directory inside it, and the server starts on an empty store."""
    with LmdbStore(path, 16 << 20) as store:
        for i in range(40):
            put(store, i, size=6000)
    truncate_to(0.5)(path / "data.mdb")
    damaged_bytes = (path / "data.mdb").read_bytes()
    mount_point(path, monkeypatch)
    with LmdbStore(path, None, replace_damaged=True) as store:
        aside = store.moved_aside
        assert aside.parent == path and aside.name.startswith(f"{path.name}.damaged-")
        assert store.stats().entries == 0
        put(store, 1)
    assert (aside / "data.mdb").read_bytes() == damaged_bytes
    with LmdbStore(path, None) as store:
        assert same(store.get(key(1)), record(1))


def test_a_store_on_a_read_only_filesystem_is_repaired_into_another_directory(
    path: Path, tmp_path: Path, monkeypatch
) -> None:
    """A failing disk is mounted read-only to rescue what it holds: the writer lock cannot
    be taken there, and need not be (no one can write it)."""
    from storage import lmdb_repair

    with LmdbStore(path, 16 << 20) as store:
        for i in range(5):
            put(store, i, size=300)
    statvfs = os.statvfs

    def read_only(where):
        st = statvfs(where)
        if Path(where) != path:
            return st
        return os.statvfs_result((*st[:8], st.f_flag | os.ST_RDONLY, st.f_namemax))

    def no_lock(where):
        raise StoreError(f"cannot open {where / 'writer.lock'}: Read-only file system")

    monkeypatch.setattr(lmdb_repair.os, "statvfs", read_only)
    monkeypatch.setattr(lmdb_repair, "lock_writer", no_lock)
    with pytest.raises(StoreError, match="read-only filesystem: it can be repaired into another"):
        LmdbStore.repair(path)
    result = LmdbStore.repair(path, tmp_path / "rescued")
    assert result.salvaged == 5
    with LmdbStore(tmp_path / "rescued", None) as store:
        assert all(same(store.get(key(i)), record(i, size=300)) for i in range(5))


def test_a_repair_in_place_on_a_mount_point_builds_and_swaps_inside_it(path: Path, monkeypatch) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(20):
            put(store, i, size=300)
    mount_point(path, monkeypatch)
    result = LmdbStore.repair(path)
    assert result.output == path and result.salvaged == 20
    assert result.moved_aside.parent == path and (result.moved_aside / "data.mdb").exists()
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == [result.moved_aside.name]
    with LmdbStore(path, None) as store:
        assert all(same(store.get(key(i)), record(i, size=300)) for i in range(20))
