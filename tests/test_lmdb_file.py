"""A damaged LMDB data file: refused before LMDB maps it, and checked page by page (every
page one owner, leaked pages reported, damaged overflow runs found)."""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import stat
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from storage.base import BlockKey, StoreError
from storage.lmdb_store import (
    DESCRIPTOR_NAME,
    LmdbStore,
)

from lmdb_testing import REPO, key, leak_past_the_last_page, put, record, same, truncate_to
from lmdb_testing import path  # noqa: F401  (a fixture)


# ---------------------------------------------------------------- a damaged data file


def damage_meta(field_offset: int) -> Callable[[Path], None]:
    """Overwrite four bytes of meta page 0 (16: magic, 20: version)."""

    def damage(data: Path) -> None:
        with open(data, "r+b") as f:
            f.seek(field_offset)
            f.write(b"\xff\xff\xff\x7f")

    return damage


DAMAGE = {
    "truncated to a half": truncate_to(0.5),
    "truncated to a tenth": truncate_to(0.1),
    "truncated to one page": lambda data: os.truncate(data, 4096),
    "bad magic": damage_meta(16),
    "bad version": damage_meta(20),
}

OPEN_DAMAGED = """
import json, sys
from storage.lmdb_store import LmdbStore
from storage.base import StoreError
out = {}
for readonly in (False, True):
    try:
        LmdbStore(sys.argv[1], None, readonly=readonly).close()
        out[str(readonly)] = "opened"
    except StoreError as e:
        out[str(readonly)] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_data_file_is_refused_before_it_is_mapped(path: Path, damage: str) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(80):
            put(store, i, size=6000)
    DAMAGE[damage](path / "data.mdb")
    before = sorted(os.listdir(path))
    child = subprocess.run(  # a SIGBUS would kill the test run: open it in a child
        [sys.executable, "-c", OPEN_DAMAGED, str(path)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert child.returncode == 0, child.stderr
    for readonly, outcome in json.loads(child.stdout).items():
        assert outcome.startswith("DamagedStore: ") and "data.mdb is damaged" in outcome, (
            readonly, outcome,
        )
    assert sorted(os.listdir(path)) == before


def test_replace_damaged_moves_the_store_aside_and_starts_empty(path: Path) -> None:
    from storage.lmdb_store import DamagedStore

    with LmdbStore(path, 16 << 20) as store:
        for i in range(40):
            put(store, i, size=6000)
    truncate_to(0.5)(path / "data.mdb")
    damaged_bytes = (path / "data.mdb").read_bytes()
    with pytest.raises(DamagedStore):
        LmdbStore(path, None)
    with LmdbStore(path, None, replace_damaged=True) as store:
        aside = store.moved_aside
        assert aside is not None and aside.name.startswith(f"{path.name}.damaged-")
        assert store.capacity_bytes == 16 << 20 and store.stats().entries == 0
        put(store, 1)
        assert store.flush()
    assert (aside / "data.mdb").read_bytes() == damaged_bytes
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    with LmdbStore(path, None, replace_damaged=True) as store:
        assert store.moved_aside is None and same(store.get(key(1)), record(1))


def damage_root_page(path: Path, db: str) -> None:
    """Make the root page of ``db`` neither a branch nor a leaf page."""
    from storage.lmdb_file import DataFile, Walk

    with DataFile.open(path) as f:
        metas, _ = f.metas()
        root = Walk(f, metas[0]).named_dbs(metas[0].main)[db].root
        page_size = metas[0].page_size
    data = bytearray((path / "data.mdb").read_bytes())
    struct.pack_into("=H", data, root * page_size + 10, 0)  # the page's flags
    (path / "data.mdb").write_bytes(data)


def test_a_budget_whose_map_cannot_be_reserved_leaves_the_store_as_it_was(path: Path, monkeypatch) -> None:
    import storage.lmdb_layout

    with LmdbStore(path, 16 << 20) as store:
        put(store, 1)
    before = (path / "tiered_kv.json").read_bytes()
    open_env = storage.lmdb_layout.open_env

    def no_room(path, *, map_size, **kwargs):
        if map_size > 1 << 40:
            raise StoreError(f"{path}: cannot open the LMDB environment: Cannot allocate memory")
        return open_env(path, map_size=map_size, **kwargs)

    monkeypatch.setattr(storage.lmdb_layout, "open_env", no_room)
    with pytest.raises(StoreError, match="Cannot allocate memory"):
        LmdbStore(path, 64 << 40)  # 64 TiB: its map does not fit the address space
    assert (path / "tiered_kv.json").read_bytes() == before  # not the new budget
    with LmdbStore(path, None) as store:  # it opens as before, records and all
        assert store.capacity_bytes == 16 << 20 and same(store.get(key(1)), record(1))


def test_a_new_store_that_cannot_be_opened_leaves_its_directory_empty(path: Path, monkeypatch) -> None:
    """A first open with a map too large (a budget mistyped) or on a full disk must not
    leave a descriptor behind: every later open, with any budget, would take its map."""
    import storage.lmdb_layout

    open_env = storage.lmdb_layout.open_env

    def no_room(where, *, map_size, **kwargs):
        if map_size > 1 << 40:
            for name in ("data.mdb", "lock.mdb"):  # LMDB creates its files before mapping
                (where / name).write_bytes(bytes(8192))
            raise StoreError(f"{where}: cannot reserve a map for the store")
        return open_env(where, map_size=map_size, **kwargs)

    monkeypatch.setattr(storage.lmdb_layout, "open_env", no_room)
    with pytest.raises(StoreError, match="cannot reserve a map"):
        LmdbStore(path, 64 << 40)
    assert not {DESCRIPTOR_NAME, "data.mdb", "lock.mdb"} & set(os.listdir(path))
    with LmdbStore(path, 16 << 20) as store:
        assert store.capacity_bytes == 16 << 20
        put(store, 1)
    with LmdbStore(path, None) as store:
        assert same(store.get(key(1)), record(1))


def test_a_readonly_open_of_a_store_whose_creation_was_cut_short_says_so(path: Path) -> None:
    with LmdbStore(path, 16 << 20):
        pass
    (path / "data.mdb").write_bytes(b"")  # the disk was full when LMDB wrote its first pages
    with pytest.raises(StoreError, match="no data yet .* creation was cut short"):
        LmdbStore(path, readonly=True)
    with LmdbStore(path, None) as store:  # a writer completes it
        put(store, 1)
    with LmdbStore(path, readonly=True) as store:
        assert same(store.get(key(1)), record(1))


def test_the_reader_table_gets_its_blocks_before_lmdb_maps_it(path: Path, tmp_path: Path, monkeypatch) -> None:
    """LMDB writes lock.mdb through a shared map: on a full disk a page without a block
    kills the process with SIGBUS. Its blocks are allocated first, so a full disk is an
    error; and at the size LMDB itself gives the file, which it keeps."""
    plain = tmp_path / "plain"
    plain.mkdir()
    lmdb.open(str(plain), max_readers=100).close()
    with LmdbStore(path, 16 << 20, max_readers=100):
        assert (path / "lock.mdb").stat().st_size == (plain / "lock.mdb").stat().st_size
    (path / "lock.mdb").unlink()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    for readonly in (False, True):
        with pytest.raises(StoreError, match="lock.mdb: cannot allocate .*No space left"):
            LmdbStore(path, None, readonly=readonly)


def test_a_writer_lock_whose_pid_cannot_be_written_still_locks(path: Path, monkeypatch, caplog) -> None:
    from storage import lmdb_directory

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lmdb_directory.os, "pwrite", full)
    with LmdbStore(path, 16 << 20):
        with pytest.raises(StoreError, match="already open for writing"):
            LmdbStore(path, None)
    assert "cannot write our pid" in caplog.text


def test_replace_damaged_also_covers_a_damaged_meta_db(path: Path) -> None:
    """The index is read from the meta db after the store opens: a damaged page there is
    as much a damaged store as one found while opening (the engine did not start)."""
    from storage.lmdb_store import DamagedStore

    with LmdbStore(path, 16 << 20) as store:
        for i in range(40):
            put(store, i, size=300)
    damage_root_page(path, "meta")
    with pytest.raises(DamagedStore):
        LmdbStore(path, None)
    with LmdbStore(path, None, replace_damaged=True) as store:
        assert store.moved_aside is not None and store.stats().entries == 0
        put(store, 1)
        assert store.flush() and same(store.get(key(1)), record(1))


def test_a_read_that_meets_a_damaged_page_forgets_its_keys_and_has_the_store_checked(path: Path) -> None:
    from storage.lmdb_layout import DAMAGE_MARK_NAME

    with LmdbStore(path, 16 << 20) as store:
        for i in range(20):
            put(store, i, size=300)
    damage_root_page(path, "records")
    with LmdbStore(path, None, replace_damaged=True) as store:  # opening reads no record
        assert store.moved_aside is None and store.contains(key(3))
        assert store.get(key(3)) is None and store.get_many([key(4), key(5)]) == [None, None]
        assert store.stats().corrupt == 3
        assert not store.contains(key(3))  # no longer advertised: the next save stores it
        assert (path / DAMAGE_MARK_NAME).exists()
    with LmdbStore(path, None, replace_damaged=True) as store:  # checked page by page
        assert store.moved_aside is not None and store.stats().entries == 0
    assert not (path / DAMAGE_MARK_NAME).exists()
    # A mark on a sound store: checked, found sound, the mark dropped, the records kept.
    with LmdbStore(path, None) as store:
        put(store, 1)
    (path / DAMAGE_MARK_NAME).touch()
    with LmdbStore(path, None) as store:
        assert same(store.get(key(1)), record(1))
    assert not (path / DAMAGE_MARK_NAME).exists()


def test_full_check_reads_every_page_before_mapping(path: Path) -> None:
    from storage.lmdb_store import DamagedStore

    with LmdbStore(path, 16 << 20) as store:
        for i in range(200):
            put(store, i, size=300)  # small records: the records db has branch pages
    with LmdbStore(path, readonly=True, full_check=True) as store:
        assert store.stats().entries == 200
    # Every branch page (flags 0x01) claims more node pointers than it has room for.
    data = bytearray((path / "data.mdb").read_bytes())
    for at in range(2 * 4096, len(data), 4096):
        if int.from_bytes(data[at + 10 : at + 12], "little") == 0x01:
            data[at + 12 : at + 14] = (4000).to_bytes(2, "little")  # mp_lower past mp_upper
    (path / "data.mdb").write_bytes(bytes(data))
    for readonly in (True, False):
        with pytest.raises(DamagedStore, match="page"):
            LmdbStore(path, None, readonly=readonly, full_check=True)


def overflow_run_of(path: Path, k: BlockKey) -> int:
    """The first page of the run of overflow pages that holds ``k``'s record."""
    from storage.lmdb_file import DataFile, Walk, _Overflow

    with DataFile.open(path) as f:
        metas, _ = f.metas()
        walk = Walk(f, metas[0])
        records = walk.named_dbs(metas[0].main)["records"]
        (run,) = [n.data for n in walk.leaves("records", records) if n.key == k.to_bytes()]
    assert isinstance(run, _Overflow)
    return run.page


@pytest.mark.parametrize("field, value, problem", [
    (0, struct.pack("=Q", 2), "is not the page its link expects"),  # its page number
    (10, struct.pack("=H", 0x02), "is not the page its link expects"),  # flags: a leaf page
    (12, struct.pack("=I", 1 << 20), "counts 1048576 pages, past the last page"),  # page count
], ids=["page number", "flags", "page count"])
def test_a_damaged_overflow_page_header_is_damage(path: Path, tmp_path: Path, field, value, problem) -> None:
    """LMDB reads a value without its run's header, but frees as many pages as the header
    counts: a damaged header is a damaged file, refused before mapping and never served."""
    from storage.lmdb_file import check_structure
    from storage.lmdb_store import DamagedStore

    with LmdbStore(path, 16 << 20) as store:
        for i in range(10):
            put(store, i, size=9000)  # each on a run of overflow pages
    assert check_structure(path).problems == []
    with open(path / "data.mdb", "r+b") as f:
        f.seek(overflow_run_of(path, key(3)) * 4096 + field)
        f.write(value)
    problems = check_structure(path).problems
    assert any(problem in p for p in problems), problems
    for readonly in (True, False):
        with pytest.raises(DamagedStore, match=problem):
            LmdbStore(path, None, readonly=readonly, full_check=True)
    result = LmdbStore.repair(path, tmp_path / "fixed")
    assert (result.salvaged, result.skipped) == (9, 1)
    with LmdbStore(tmp_path / "fixed", readonly=True, full_check=True) as fixed:
        assert fixed.get(key(3)) is None
        assert all(same(fixed.get(key(i)), record(i, 9000)) for i in range(10) if i != 3)


def pages_of(path: Path) -> tuple[dict[int, int], set[int], set[int]]:
    """A sound file's overflow runs (first page: the page count in its header), B-tree pages
    and free pages."""
    from storage.lmdb_file import DataFile, Walk, _Overflow

    with DataFile.open(path) as f:
        meta = f.committed()
        walk = Walk(f, meta)
        nodes = [("free", node) for node in walk.leaves("free", meta.free)]
        for name, db in walk.named_dbs(meta.main).items():
            nodes += [(name, node) for node in walk.leaves(name, db)]
        runs: dict[int, int] = {}  # a long page list of the free db is on one too
        free: set[int] = set()
        for name, node in nodes:
            if isinstance(node.data, _Overflow):
                head = f.read(node.data.page * meta.page_size, 16)
                runs[node.data.page] = struct.unpack_from("=I", head, 12)[0]
            if name == "free":
                listed = walk.value(name, node)
                free.update(struct.unpack_from(f"={len(listed) // 8}Q", listed)[1:])
        tree = {page for page in range(2, meta.last_page + 1) if walk.owners.is_tree(page)}
    return runs, tree, free


def test_a_sound_file_has_one_owner_for_every_page(path: Path) -> None:
    """Values of many sizes put, replaced, deleted and evicted over many commits: pages move
    between runs, tree pages and the free list, and every page still has one owner."""
    from storage.lmdb_file import check_data_file, check_structure

    rng = random.Random(0)
    for _ in range(3):  # reopened: each open commits too, and picks the free list up again
        with LmdbStore(path, 8 << 20) as store:  # a small budget: evictions free runs too
            for _ in range(2):
                for _ in range(80):
                    put(store, rng.randrange(200), size=rng.choice([300, 9000, 40_000, 150_000]))
                store.delete_many([key(rng.randrange(200)) for _ in range(20)])
                assert store.flush()
                assert check_structure(path) == ([], (0, ()))  # no damage, no leaked page
    runs, tree, free = pages_of(path)
    assert len(runs) > 30 and free
    in_runs = [page for first, count in runs.items() for page in range(first, first + count)]
    owned = sorted([*in_runs, *tree, *free])
    assert owned == list(range(2, check_data_file(path).last_page + 1))  # each page once
    with LmdbStore(path, readonly=True, full_check=True) as store:
        assert store.leaked == (0, ())
        result = store.verify()
        assert result.checked > 0 and result.corrupt == 0


def drop_node(path: Path, k: BlockKey) -> None:
    """Take ``k``'s node out of its leaf page, as a lost link would: its run of overflow
    pages stays in the file, and nothing claims it."""
    from storage.lmdb_file import PAGE, DataFile, Walk

    run = overflow_run_of(path, k)
    with DataFile.open(path) as f:
        meta = f.committed()
        walk = Walk(f, meta)
        for name, db in walk.named_dbs(meta.main).items():
            list(walk.leaves(name, db))
    data = bytearray((path / "data.mdb").read_bytes())
    node = k.to_bytes() + struct.pack("=Q", run)  # key, then the run's first page
    at = data.find(node)
    while True:  # skip older copies of the leaf: on free pages, or stale bytes in a page's gap
        assert at >= 0, "no live node for the key"
        page, offset = divmod(at - 8, 4096)  # the node's header: 8 bytes before its key
        start = page * 4096
        _, _, _, lower, _ = PAGE.unpack_from(data, start)
        pointers = list(struct.unpack_from(f"={(lower - 16) // 2}H", data, start + 16))
        if walk.owners.is_tree(page) and offset in pointers:
            break
        at = data.find(node, at + 1)
    pointers.remove(offset)
    struct.pack_into(f"={len(pointers)}H", data, start + 16, *pointers)
    struct.pack_into("=H", data, start + 12, lower - 2)
    (path / "data.mdb").write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["past the last page", "a record's lost run"])
def test_pages_nothing_claims_are_leaked_not_damage(path: Path, tmp_path: Path, caplog, how) -> None:
    """A page below the last one that no tree, value or free list claims is leaked: reported
    with a warning, the file still opens and serves; LMDB never reuses such a page, and its
    compacting copy refuses the file. Repair rebuilds the store without it."""
    from storage.lmdb_file import check_structure

    with LmdbStore(path, 16 << 20) as store:
        for i in range(30):
            put(store, i, size=9000)  # each on a run of 3 pages
    assert check_structure(path) == ([], (0, ()))
    if how == "past the last page":
        last = leak_past_the_last_page(path, 3)
        leaked, kept = (last + 1, last + 2, last + 3), range(30)
    else:
        run = overflow_run_of(path, key(7))
        drop_node(path, key(7))
        leaked, kept = (run, run + 1, run + 2), [i for i in range(30) if i != 7]
    assert check_structure(path) == ([], (3, leaked))
    for readonly in (True, False):
        caplog.clear()
        with caplog.at_level(logging.WARNING), LmdbStore(
            path, None, readonly=readonly, full_check=True
        ) as store:
            assert store.leaked == (3, leaked)
            assert all(same(store.get(key(i)), record(i, 9000)) for i in kept)
        pages = ", ".join(map(str, leaked))
        assert f"3 leaked pages (no tree, value or free list claims them: {pages})" in caplog.text
    with LmdbStore(path, None) as store:  # pages nothing claims are never reused
        put(store, 100, size=9000)
    assert check_structure(path) == ([], (3, leaked))
    with LmdbStore(path, readonly=True) as store, pytest.raises(StoreError, match="INCOMPATIBLE"):
        store.copy_compacted(tmp_path / "compacted")
    result = LmdbStore.repair(path, tmp_path / "fixed")
    assert (result.salvaged, result.skipped) == (len(kept) + 1, 0)
    assert check_structure(tmp_path / "fixed") == ([], (0, ()))


@pytest.mark.parametrize("over", ["run", "tree", "free"])
def test_an_overflow_run_over_another_owners_page_is_damage(path: Path, tmp_path: Path, over) -> None:
    """A run's header counting one page too many, into the next value's run, a tree page or
    a free page: LMDB reads every value right, but deleting this one would free a page that
    is still in use, for the next write to overwrite. The file check names both owners."""
    from storage.lmdb_file import check_structure
    from storage.lmdb_store import DamagedStore

    with LmdbStore(path, 16 << 20) as store:
        for i in range(120):
            put(store, i, size=9000)  # each on a run of 3 pages
            if i % 40 == 39:
                assert store.flush()  # each commit copies tree pages and frees the old ones
    runs, tree, free = pages_of(path)
    first, count = next(
        (first, count) for first, count in sorted(runs.items())
        if first + count in {"run": runs.keys(), "tree": tree, "free": free}[over]
    )
    page = first + count
    with open(path / "data.mdb", "r+b") as f:
        f.seek(first * 4096 + 12)
        f.write(struct.pack("=I", count + 1))
    (problem,) = check_structure(path).problems
    # The walk meets one owner of the page first; the problem is about the other.
    owner = {
        "run": f"the records db's overflow run at page {page}",
        "tree": r"the \w+ db's tree",
        "free": "the free list",
    }[over]
    met_second = {
        "run": f"the overflow run at page {page} overlaps page {page} of",
        "tree": f"a link to page {page} leads into",
        "free": "(?!)",  # the free list is walked first
    }[over]
    assert re.fullmatch(
        rf"records db: the overflow run at page {first} overlaps page {page} of {owner}"
        rf"|\w+ db: {met_second} the records db's overflow run at page {first}",
        problem,
    ), problem
    for readonly in (True, False):
        with pytest.raises(DamagedStore, match=problem):
            LmdbStore(path, None, readonly=readonly, full_check=True)
    result = LmdbStore.repair(path, tmp_path / "fixed")
    assert (result.salvaged, result.skipped) == (120, 0)  # each value's bytes are its own
    with LmdbStore(tmp_path / "fixed", readonly=True, full_check=True) as fixed:
        assert all(same(fixed.get(key(i)), record(i, 9000)) for i in range(120))
