from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import logging
import os
import random
import re
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
import torch

from storage.base import BlockKey, StoreError
from storage.lmdb_store import (
    DESCRIPTOR_NAME,
    FORMAT_NAME,
    STORE_VERSION,
    LmdbStore,
    default_map_size,
)
from storage.record import SEAL_SIZE, Record, RecordError, decode_record, encode_record
from storage.seal import KEY_FILE_NAME, SealKey, load_key_file

REPO = Path(__file__).resolve().parents[1]
NS = hashlib.sha256(b"test namespace").digest()
KEY = SealKey(b"the tests' own secret, thirty-two bytes+")  # compares records as bytes
OTHER_NS = hashlib.sha256(b"other namespace").digest()


def key(i: int, ns: bytes = NS) -> BlockKey:
    return BlockKey(ns, hashlib.sha256(i.to_bytes(8, "little")).digest())


def record(i: int, size: int = 1000, ns: bytes = NS) -> Record:
    return Record(
        key=key(i, ns),
        parent_hash=None,
        token_ids=tuple(range(i, i + 16)),
        codec="raw",
        dtype=torch.uint8,
        shape=(size,),
        payload=random.Random(i).randbytes(size),
        created_ns=1_000 + i,
    )


def put(store: LmdbStore, i: int, size: int = 1000, ns: bytes = NS) -> bool:
    return store.put(key(i, ns), record(i, size, ns))


def same(a: Record | None, b: Record) -> bool:
    return a is not None and encode_record(a, KEY) == encode_record(b, KEY)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "store"


class BlockedWriter:
    """Hold the writer thread before its next commit until released."""

    def __init__(self, store: LmdbStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        original = store._write_txn

        def blocked(*args, **kwargs):
            self.release.wait(10)
            return original(*args, **kwargs)

        monkeypatch.setattr(store, "_write_txn", blocked)


# ---------------------------------------------------------------- directory and descriptor


def test_new_store_is_private_and_described(path: Path) -> None:
    with LmdbStore(path, 1 << 20) as store:
        assert store.info().entries == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for name in ("data.mdb", "lock.mdb", "writer.lock", DESCRIPTOR_NAME, KEY_FILE_NAME):
        assert stat.S_IMODE((path / name).stat().st_mode) & 0o077 == 0, name
    fields = json.loads((path / DESCRIPTOR_NAME).read_text())
    assert fields["format"] == FORMAT_NAME
    assert fields["version"] == STORE_VERSION
    assert fields["capacity_bytes"] == 1 << 20
    assert fields["map_size"] == default_map_size(1 << 20)
    assert fields["created_ns"] > 0 and fields["created"].endswith("Z")


def test_reopen_keeps_creation_time_and_records_new_capacity(path: Path) -> None:
    LmdbStore(path, 1 << 20).close()
    created = json.loads((path / DESCRIPTOR_NAME).read_text())["created_ns"]
    with LmdbStore(path, 2 << 20) as store:
        assert store.capacity_bytes == 2 << 20
    with LmdbStore(path) as store:  # capacity from the descriptor
        assert store.capacity_bytes == 2 << 20
    fields = json.loads((path / DESCRIPTOR_NAME).read_text())
    assert fields["created_ns"] == created and fields["capacity_bytes"] == 2 << 20


def test_refuses_a_directory_that_is_not_a_store(path: Path) -> None:
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a tiered-kv disk store"):
        LmdbStore(path, 1 << 20)
    assert sorted(os.listdir(path)) == ["notes.txt"]  # nothing was created there
    with pytest.raises(StoreError, match="not a tiered-kv disk store"):
        LmdbStore(path, readonly=True)


@pytest.mark.parametrize("edit", [
    {"capacity_bytes": -1}, {"capacity_bytes": 0}, {"map_size": 0}, {"version": True}, {"version": 0},
])
def test_a_hand_edited_descriptor_with_impossible_values_is_refused(path: Path, edit) -> None:
    LmdbStore(path, 1 << 20).close()
    fields = json.loads((path / DESCRIPTOR_NAME).read_text())
    (path / DESCRIPTOR_NAME).write_text(json.dumps({**fields, **edit}))
    for open_it in (lambda: LmdbStore(path), lambda: LmdbStore(path, readonly=True)):
        with pytest.raises(StoreError, match="descriptor"):
            open_it()


def test_refuses_another_format(path: Path) -> None:
    path.mkdir()
    (path / DESCRIPTOR_NAME).write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(StoreError, match="not a tiered-kv disk store"):
        LmdbStore(path, 1 << 20)


def test_refuses_a_newer_store_version(path: Path) -> None:
    LmdbStore(path, 1 << 20).close()
    fields = json.loads((path / DESCRIPTOR_NAME).read_text())
    fields["version"] = STORE_VERSION + 1
    (path / DESCRIPTOR_NAME).write_text(json.dumps(fields))
    for readonly in (False, True):
        with pytest.raises(StoreError, match="newer tiered-kv"):
            LmdbStore(path, 1 << 20, readonly=readonly)


def open_in_child(path: Path, as_user: int | None) -> str:
    """Try to open ``path`` for writing in a forked child, optionally as another user."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        message = "opened"
        try:
            if as_user is not None:
                os.setgid(as_user)
                os.setuid(as_user)
            LmdbStore(path, 1 << 20).close()
        except StoreError as e:
            message = f"refused: {e}"
        except BaseException as e:
            message = f"failed: {e!r}"
        os.write(write_end, message.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message


def test_refuses_to_write_a_read_only_directory() -> None:
    # Root ignores directory permissions, so as root the attempt is made as "nobody".
    nobody = 65534 if os.geteuid() == 0 else None
    with tempfile.TemporaryDirectory() as top:
        os.chmod(top, 0o755)
        path = Path(top) / "store"
        with LmdbStore(path, 1 << 20) as store:
            put(store, 1)
        if nobody is not None:
            for p in (path, *path.iterdir()):
                os.chown(p, nobody, nobody)
        os.chmod(path, 0o500)
        try:
            message = open_in_child(path, nobody)
        finally:
            os.chmod(path, 0o700)
        assert message.startswith("refused:") and "not writable" in message, message


def test_second_writer_is_refused(path: Path) -> None:
    with LmdbStore(path, 1 << 20):
        with pytest.raises(StoreError, match=f"already open for writing .by pid {os.getpid()}"):
            LmdbStore(path, 1 << 20)
    LmdbStore(path, 1 << 20).close()  # the lock went with the first writer


def test_read_only_reader_in_another_process_while_writing(path: Path) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(20):
            put(store, i)
        store.flush()
        code = f"""
import json, sys
sys.path.insert(0, {str(REPO / "tests")!r})
from test_lmdb_store import NS, key, record, same
from storage.lmdb_store import LmdbStore
from storage.base import StoreError
out = {{}}
with LmdbStore({str(path)!r}, readonly=True) as ro:
    out["same"] = all(same(ro.get(key(i)), record(i)) for i in range(20))
    out["keys"] = len(list(ro.keys(NS)))
    out["entries"] = ro.stats().entries >= 20
    out["prefix"] = ro.longest_prefix([key(0), key(1), key(999)])
    try:
        ro.put(key(99), record(99))
    except StoreError:
        out["put_refused"] = True
try:
    LmdbStore({str(path)!r}, 1 << 20)
except StoreError as e:
    out["writer_refused"] = "already open for writing" in str(e)
print(json.dumps(out))
"""
        reader = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=REPO,
        )
        i = 100
        while reader.poll() is None:  # keep committing while the reader works
            put(store, i, ns=OTHER_NS)
            store.flush()
            i += 1
        stdout, stderr = reader.communicate()
        assert reader.returncode == 0, stderr
        assert json.loads(stdout) == {
            "same": True, "keys": 20, "entries": True, "prefix": 2,
            "put_refused": True, "writer_refused": True,
        }
        assert all(same(store.get(key(j, OTHER_NS)), record(j, ns=OTHER_NS)) for j in range(100, i))


def test_stale_reader_slots_are_reclaimed(path: Path) -> None:
    with LmdbStore(path, 1 << 20, reader_check_interval=0.05) as store:
        put(store, 1)
        store.flush()
        code = f"""
import time
from storage.lmdb_store import LmdbStore
ro = LmdbStore({str(path)!r}, readonly=True)
txn = ro._env.begin()
print("reading", flush=True)
time.sleep(60)
"""
        reader = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        assert reader.stdout.readline().strip() == "reading"
        assert reader.pid in store.info().reader_pids
        reader.kill()
        reader.wait()
        deadline = time.monotonic() + 5
        while reader.pid in store.info().reader_pids and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reader.pid not in store.info().reader_pids


# ---------------------------------------------------------------- the block-store contract


def test_read_your_writes_before_the_commit(path: Path, monkeypatch) -> None:
    with LmdbStore(path, 1 << 20) as store:
        blocked = BlockedWriter(store, monkeypatch)
        assert put(store, 1) and put(store, 2)
        assert same(store.get(key(1)), record(1))
        assert store.contains(key(2)) and not store.contains(key(3))
        assert store.longest_prefix([key(1), key(2), key(3), key(1)]) == 2
        assert store.contains_many([key(3), key(1)]) == [False, True]
        assert sorted(store.keys()) == sorted([key(1), key(2)])
        assert store.delete(key(2)) and not store.delete(key(2))
        assert store.get(key(2)) is None
        assert store.stats().entries == 1
        assert store.pending_bytes > 0
        assert not store.flush(timeout=0.05)
        blocked.release.set()
        assert store.flush(timeout=5)
        assert store.pending_bytes == 0
        assert [same(r, record(1)) for r in store.get_many([key(1), key(2)])] == [True, False]


def test_values_are_owned_by_the_caller(path: Path) -> None:
    with LmdbStore(path, 1 << 20) as store:
        put(store, 1)
        pending = store.get(key(1))
        store.flush()
        committed = store.get(key(1))
        replacement = Record(key(1), None, (7,), "raw", torch.uint8, (5,), b"other")
        store.put(key(1), replacement)
        store.flush()
        assert same(pending, record(1)) and same(committed, record(1))
        assert bytes(store.get(key(1)).payload) == b"other"


def test_reading_serves_committed_records_from_the_map_and_pending_ones_too(path: Path) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(4):
            put(store, i)
        store.flush()
        put(store, 4)  # still pending
        with store.reading([key(i) for i in range(6)]) as found:
            assert [same(r, record(i)) for i, r in enumerate(found[:5])] == [True] * 5
            assert found[5] is None
            assert not isinstance(found[0].payload.obj, bytes)  # a view of the map, not a copy
            # a write meanwhile does not disturb the records in hand
            store.put(key(0), Record(key(0), None, (7,), "raw", torch.uint8, (5,), b"other"))
            store.flush()
            assert same(found[0], record(0))
        assert bytes(store.get(key(0)).payload) == b"other"
        assert (store.stats().hits, store.stats().misses) == (6, 1)


def test_reading_finds_a_corrupt_record_like_get(path: Path) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(3):
            put(store, i)
    corrupt_stored(path, key(1), flip)
    with LmdbStore(path, 16 << 20) as store:
        with store.reading([key(0), key(1), key(2)]) as found:
            assert found[1] is None and same(found[0], record(0)) and same(found[2], record(2))
        assert store.stats().corrupt == 1 and not store.contains(key(1))


def test_flushed_records_survive_reopening(path: Path) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(50):
            put(store, i, size=100 * i + 1)
        store.delete(key(7))
        assert store.flush(timeout=10)
    with LmdbStore(path, 16 << 20) as store:
        assert store.stats().entries == 49
        assert store.get(key(7)) is None
        assert all(same(store.get(key(i)), record(i, 100 * i + 1)) for i in range(50) if i != 7)
        stats = store.stats()
        assert (stats.hits, stats.misses) == (49, 1)


def test_counters(path: Path) -> None:
    with LmdbStore(path, 1 << 20) as store:
        put(store, 1)
        put(store, 2)
        store.get(key(1))
        store.get(key(9))
        store.flush()
        stats = store.stats()
        assert (stats.tier, stats.puts, stats.hits, stats.misses) == ("disk", 2, 1, 1)
        assert stats.entries == 2 and stats.bytes_used == 2 * record(1).nbytes
        assert stats.bytes_written == stats.bytes_used and stats.bytes_read == record(1).nbytes


def test_keys_by_namespace_each_once(path: Path, monkeypatch) -> None:
    with LmdbStore(path, 64 << 20) as store:
        for i in range(1500):  # more than one chunk
            put(store, i, size=10)
        for i in range(300):
            put(store, i, size=10, ns=OTHER_NS)
        store.flush()
        blocked = BlockedWriter(store, monkeypatch)
        put(store, 5000, size=10)  # pending
        store.delete(key(3))  # pending
        keys = list(store.keys())
        assert len(keys) == len(set(keys)) == 1800
        mine = list(store.keys(NS))
        assert sorted(mine) == sorted(key(i) for i in [*range(1500), 5000] if i != 3)
        assert sorted(store.keys(OTHER_NS)) == sorted(key(i, OTHER_NS) for i in range(300))
        blocked.release.set()


def test_put_of_a_mismatched_key_is_an_error(path: Path) -> None:
    with LmdbStore(path, 1 << 20) as store:
        with pytest.raises(ValueError):
            store.put(key(2), record(1))


def test_record_larger_than_the_capacity_is_refused(path: Path) -> None:
    with LmdbStore(path, 4096) as store:
        assert not put(store, 1, size=5000)
        assert put(store, 2, size=1000)
        stats = store.stats()
        assert (stats.dropped, stats.puts, stats.entries) == (1, 1, 1)


def test_close_is_idempotent_and_final(path: Path) -> None:
    store = LmdbStore(path, 1 << 20)
    put(store, 1)
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        put(store, 2)
    with pytest.raises(StoreError, match="closed"):
        store.get(key(1))
    with LmdbStore(path, 1 << 20) as store:  # close() committed the pending put
        assert same(store.get(key(1)), record(1))


def test_put_waits_while_too_much_is_pending(path: Path, monkeypatch) -> None:
    with LmdbStore(path, 1 << 20, max_pending_bytes=3000) as store:
        blocked = BlockedWriter(store, monkeypatch)
        put(store, 1)
        put(store, 2)
        done = threading.Event()
        threading.Thread(target=lambda: (put(store, 3), done.set())).start()
        assert not done.wait(0.2)
        blocked.release.set()
        assert done.wait(5)
        store.flush()
        assert all(same(store.get(key(i)), record(i)) for i in (1, 2, 3))


def test_one_put_many_larger_than_the_pending_bound_wakes_the_writer(path: Path) -> None:
    """A group of puts is queued under one hold of the lock and wakes the writer once; a
    put of the group that must wait for room first wakes it for those before it."""
    with LmdbStore(path, 1 << 20, max_pending_bytes=2500) as store:
        start = time.monotonic()
        assert store.put_many([(key(i), record(i)) for i in range(6)]) == [True] * 6
        assert time.monotonic() - start < 5  # the writer's own timeout is 30 s
        store.flush()
        assert all(same(store.get(key(i)), record(i)) for i in range(6))


def test_concurrent_use_stays_consistent(path: Path) -> None:
    sizes = {i: 200 + 97 * i for i in range(60)}
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            i = rng.randrange(60)
            action = rng.random()
            if action < 0.4:
                put(store, i, sizes[i])
            elif action < 0.5:
                store.delete(key(i))
            elif action < 0.95:
                got = store.get(key(i))
                if got is not None and not same(got, record(i, sizes[i])):
                    errors.append(f"block {i} read back wrong")
            else:
                store.flush()

    with LmdbStore(path, 60_000, max_batch_items=4, sync=False) as store:
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store.flush()
        expected = sorted(store.keys())
        used = store.stats().bytes_used
        assert used <= 60_000 and not errors
    with LmdbStore(path, 60_000) as store:
        assert sorted(store.keys()) == expected
        assert store.stats().bytes_used == used
        result = store.verify()
        assert result.checked > 0 and result.corrupt == 0


# ---------------------------------------------------------------- capacity and eviction


def test_least_recently_accessed_is_evicted_first(path: Path) -> None:
    size = record(0).nbytes
    evicted: list[BlockKey] = []
    with LmdbStore(path, 4 * size, on_evict=evicted.append) as store:
        for i in range(4):
            put(store, i)
        store.get(key(0))
        put(store, 4)
        assert evicted == [key(1)]
        put(store, 5)
        assert evicted == [key(1), key(2)]
        store.flush()
        assert sorted(store.keys()) == sorted(key(i) for i in (0, 3, 4, 5))
        assert store.stats().evictions == 2 and store.stats().bytes_used == 4 * size


def test_removals_count_evictions_and_deletes_not_puts_or_reads(path: Path) -> None:
    size = record(0).nbytes
    with LmdbStore(path, 2 * size) as store:
        put(store, 0)
        put(store, 1)
        put(store, 1)  # replaced
        store.get(key(0))
        store.flush()
        assert store.removals == 0
        put(store, 2)  # evicts key(1)
        assert store.removals == 1 and not store.contains(key(1))
        assert store.delete(key(0)) and store.removals == 2
        assert not store.delete(key(0)) and store.removals == 2
        store.flush()
    with LmdbStore(path, readonly=True) as store, pytest.raises(RuntimeError, match="read-only"):
        store.removals


def test_access_order_survives_reopening(path: Path) -> None:
    size = record(0).nbytes
    with LmdbStore(path, 4 * size) as store:
        for i in range(4):
            put(store, i)
        store.flush()
        store.get(key(0))
        store.get(key(1))
    evicted: list[BlockKey] = []
    with LmdbStore(path, 4 * size, on_evict=evicted.append) as store:
        put(store, 4)
        put(store, 5)
        assert evicted == [key(2), key(3)]


def test_smaller_capacity_on_reopen_evicts_the_oldest(path: Path) -> None:
    size = record(0).nbytes
    with LmdbStore(path, 10 * size) as store:
        for i in range(10):
            put(store, i)
    evicted: list[BlockKey] = []
    with LmdbStore(path, 3 * size, on_evict=evicted.append) as store:
        assert evicted == [key(i) for i in range(7)]
        assert sorted(store.keys()) == sorted(key(i) for i in (7, 8, 9))


def test_tiny_budget_keeps_everything_flushed_unless_evicted(path: Path) -> None:
    rng = random.Random(5)
    sizes = {i: rng.randrange(100, 20_000) for i in range(300)}
    evicted: set[BlockKey] = set()
    with LmdbStore(path, 100_000, on_evict=evicted.add, max_batch_items=8) as store:
        for i, size in sizes.items():
            put(store, i, size)
            assert store.stats().bytes_used <= 100_000
            if i % 10 == 0:
                store.get(key(rng.randrange(i + 1), NS))
        store.flush()
        kept = [i for i in sizes if key(i) not in evicted]
        assert evicted and kept
        assert all(same(store.get(key(i)), record(i, sizes[i])) for i in kept)
        assert store.stats().evictions == len(evicted)
    with LmdbStore(path, 100_000) as store:
        assert sorted(store.keys()) == sorted(key(i) for i in kept)
        assert store.stats().bytes_used == sum(record(i, sizes[i]).nbytes for i in kept)


def test_full_map_evicts_and_retries(path: Path, caplog) -> None:
    evicted: set[BlockKey] = set()

    def kept() -> list[int]:
        return [i for i in [*range(120), 1001] if key(i) not in evicted]

    # A 16 MiB budget in a 2 MiB map: the map fills long before the budget does.
    with LmdbStore(path, 16 << 20, map_size=2 << 20, on_evict=evicted.add) as store:
        for i in range(120):
            put(store, i, size=50_000)
            if i % 10 == 9:
                assert store.flush(timeout=10)
        assert "MapFullError" in caplog.text
        assert evicted and store.stats().evictions == len(evicted)
        assert len(kept()) >= 10
        assert not put(store, 1000, size=1 << 20)  # more than half the map: refused
        # fits once much of the rest is evicted; an overflow record needs contiguous free
        # pages, and how fragmented the freed ones are depends on how the writer batched
        # the puts above, so it asks for a fifth of the map, not a third
        assert put(store, 1001, size=400_000)
        store.flush()
        stats = store.stats()
        assert stats.dropped == 1 and stats.evictions == len(evicted)
        assert all(same(store.get(key(i)), record(i, 50_000)) for i in kept() if i < 120)
        assert same(store.get(key(1001)), record(1001, 400_000))
    with LmdbStore(path, 16 << 20, map_size=2 << 20) as store:
        assert sorted(store.keys()) == sorted(key(i) for i in kept())


# ---------------------------------------------------------------- corruption


def corrupt_stored(path: Path, k: BlockKey, change) -> None:
    """Rewrite the stored bytes of ``k`` behind the store's back (the store is closed)."""
    env = lmdb.open(str(path), max_dbs=4, map_size=default_map_size(16 << 20))
    records = env.open_db(b"records")
    with env.begin(write=True, db=records) as txn:
        txn.put(k.to_bytes(), change(bytearray(txn.get(k.to_bytes()))))
    env.close()


def flip(buf: bytearray) -> bytes:
    buf[len(buf) // 2] ^= 0xFF
    return bytes(buf)


@pytest.mark.parametrize(
    "change, reason",
    [(flip, "mac"), (lambda b: bytes(b[:100]), "length"), (lambda b: b"junk" * 50, "magic")],
)
def test_corrupt_record_is_a_miss_and_quarantined(path: Path, change, reason: str) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(5):
            put(store, i)
    corrupt_stored(path, key(2), change)
    gone: list[BlockKey] = []
    with LmdbStore(path, 16 << 20, on_evict=gone.append) as store:
        assert store.get(key(2)) is None
        assert store.stats().corrupt == 1 and store.stats().misses == 1
        assert gone == [key(2)] and store.stats().evictions == 0
        assert not store.contains(key(2))
        store.flush()
        (entry,) = store.quarantined()
        assert entry.key == key(2) and entry.reason.startswith(reason)
        assert all(same(store.get(key(i)), record(i)) for i in (0, 1, 3, 4))
        assert store.stats().entries == 4
    with LmdbStore(path, 16 << 20) as store:
        assert store.get(key(2)) is None and store.stats().corrupt == 0
        assert [e.key for e in store.quarantined()] == [key(2)]
        assert store.stats().bytes_used == 4 * record(0).nbytes
        assert store.clear_quarantine() == 1 and not list(store.quarantined())


@pytest.mark.parametrize("via", ["get", "verify"])
def test_a_corrupt_record_replaced_while_it_was_checked_is_not_quarantined(
    path: Path, monkeypatch, via: str
) -> None:
    """A put of the same key commits between the read of the bad bytes and their
    quarantine: the good record it wrote stays."""
    with LmdbStore(path, 16 << 20) as store:
        put(store, 1)
        put(store, 2)
    corrupt_stored(path, key(2), flip)
    module = "storage.lmdb_admin" if via == "verify" else "storage.lmdb_reader"
    check = decode_record

    with LmdbStore(path, 16 << 20) as store:
        def decode_then_replace(data, seal_key, k, **kwargs):
            try:
                return check(data, seal_key, k, **kwargs)
            except RecordError:
                if k == key(2):
                    assert put(store, 2) and store.flush()  # the rewrite commits meanwhile
                raise

        monkeypatch.setattr(f"{module}.decode_record", decode_then_replace)
        if via == "get":
            assert store.get(key(2)) is None  # the bad bytes it read: a miss
        else:
            assert store.verify().corrupt == 1
        monkeypatch.undo()
        assert store.stats().corrupt == 1
        store.flush()
        assert not list(store.quarantined())
        assert same(store.get(key(2)), record(2)) and store.stats().entries == 2
    with LmdbStore(path, 16 << 20) as store:
        assert same(store.get(key(2)), record(2))


def test_verify_checks_every_record(path: Path) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(10):
            put(store, i)
    corrupt_stored(path, key(3), flip)
    corrupt_stored(path, key(6), flip)
    with LmdbStore(path, readonly=True) as ro:
        result = ro.verify()
        assert (result.checked, result.ok, result.corrupt, result.quarantined) == (10, 8, 2, 0)
        assert ro.get(key(3)) is None and ro.stats().corrupt == 3
    with LmdbStore(path, 16 << 20) as store:
        result = store.verify()
        assert (result.checked, result.ok, result.corrupt, result.quarantined) == (10, 8, 2, 2)
        assert sorted(e.key for e in store.quarantined()) == sorted([key(3), key(6)])
        result = store.verify()
        assert result.checked > 0 and result.corrupt == 0


def test_record_under_the_wrong_key_is_corrupt(path: Path) -> None:
    with LmdbStore(path, 16 << 20) as store:
        put(store, 1)
        put(store, 2)
    corrupt_stored(path, key(1), lambda _: encode_record(record(2), load_key_file(path / KEY_FILE_NAME)))
    with LmdbStore(path, 16 << 20) as store:
        assert store.get(key(1)) is None
        store.flush()
        assert [e.reason.split(":")[0] for e in store.quarantined()] == ["key"]


def resealed_with_altered_kv(buf: bytearray) -> bytes:
    """What a writer without the key can do: change the KV and recompute an unkeyed
    checksum (xxh3-64, the last eight bytes) over the rest."""
    import xxhash

    buf[len(buf) - SEAL_SIZE - 1] ^= 0x55  # the payload's last byte
    buf[-8:] = xxhash.xxh3_64_intdigest(bytes(buf[:-8])).to_bytes(8, "little")
    return bytes(buf)


def test_a_resealed_record_with_altered_kv_is_refused_and_deleted(path: Path) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(3):
            put(store, i)
    corrupt_stored(path, key(1), resealed_with_altered_kv)
    with LmdbStore(path, readonly=True) as ro:
        assert ro.verify().corrupt == 1
    with LmdbStore(path, 16 << 20) as store:
        assert store.get(key(1)) is None and store.stats().corrupt == 1
        store.flush()
        assert not store.contains(key(1)) and key(1) not in set(store.keys())
        assert [e.reason.split(":")[0] for e in store.quarantined()] == ["mac"]
        assert same(store.get(key(0)), record(0)) and same(store.get(key(2)), record(2))


def unsealed_store(path: Path) -> None:
    """Make ``path`` look like a store of record format 1 (before records were sealed)."""
    (path / KEY_FILE_NAME).unlink()
    fields = json.loads((path / DESCRIPTOR_NAME).read_text())
    (path / DESCRIPTOR_NAME).write_text(json.dumps(fields | {"record_format_version": 1}))


def test_an_existing_store_gets_a_private_key_and_drops_what_it_cannot_verify(
    path: Path, caplog
) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(3):
            put(store, i)
    unsealed_store(path)
    with pytest.raises(StoreError, match="storage init"):
        LmdbStore(path, readonly=True)  # a reader changes nothing and verifies nothing
    old = os.umask(0)
    try:
        with caplog.at_level(logging.WARNING), LmdbStore(path, None) as store:
            assert store.stats().entries == 0 and store.get(key(0)) is None
            put(store, 5)
    finally:
        os.umask(old)
    assert "dropped 3 records" in caplog.text
    assert stat.S_IMODE((path / KEY_FILE_NAME).stat().st_mode) == 0o600
    assert json.loads((path / DESCRIPTOR_NAME).read_text())["record_format_version"] == 2
    with LmdbStore(path, readonly=True) as ro:
        assert same(ro.get(key(5)), record(5)) and ro.seal_key == load_key_file(path / KEY_FILE_NAME)


def test_a_looser_key_file_is_made_private(path: Path) -> None:
    LmdbStore(path, 1 << 20).close()
    os.chmod(path / KEY_FILE_NAME, 0o644)
    LmdbStore(path, None).close()
    assert stat.S_IMODE((path / KEY_FILE_NAME).stat().st_mode) == 0o600


def test_records_of_another_store_do_not_verify(path: Path, tmp_path: Path) -> None:
    with LmdbStore(path, 16 << 20) as store, LmdbStore(tmp_path / "other", 16 << 20) as other:
        put(store, 1)
        store.flush()
        assert store.seal_key != other.seal_key
    with LmdbStore(path, readonly=True) as ro:
        raw = dict(ro.raw_records())[key(1)]
    with LmdbStore(tmp_path / "other", None) as other:
        put(other, 1)
    corrupt_stored(tmp_path / "other", key(1), lambda _: raw)
    with LmdbStore(tmp_path / "other", None) as other:
        assert other.get(key(1)) is None
        other.flush()
        assert [e.reason.split(":")[0] for e in other.quarantined()] == ["keyid"]


# ---------------------------------------------------------------- admin helpers


def test_namespaces_metadata_and_raw_records(path: Path) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(3):
            put(store, i)
        put(store, 7, ns=OTHER_NS)
        store.flush()
        assert sorted(store.namespaces()) == sorted([NS, OTHER_NS])
        meta = {m.key: m for m in store.metadata(NS)}
        assert set(meta) == {key(i) for i in range(3)}
        assert meta[key(1)].created_ns == 1_001 and meta[key(1)].last_access_ns > 0
        assert meta[key(1)].nbytes == len(encode_record(record(1), store.seal_key))
        raw = dict(store.raw_records())
    assert raw[key(7, OTHER_NS)] == encode_record(record(7, ns=OTHER_NS), store.seal_key)
    assert len(raw) == 4
    with LmdbStore(path, readonly=True) as reader:
        assert sorted(reader.namespaces()) == sorted([NS, OTHER_NS])
        assert len(list(reader.metadata())) == 4


def test_compacted_copy_and_compaction_in_place(path: Path, tmp_path: Path) -> None:
    with LmdbStore(path, 16 << 20) as store:
        for i in range(40):
            put(store, i, size=20_000)
        store.flush()
        store.delete_many([key(i) for i in range(30)])
        store.flush()
        store.copy_compacted(tmp_path / "copy")
        with pytest.raises(StoreError):
            store.copy_compacted(tmp_path / "copy")
    before = (path / "data.mdb").stat().st_size
    with LmdbStore(tmp_path / "copy", readonly=True) as copy:
        assert sorted(k for k, _ in copy.raw_records()) == sorted(key(i) for i in range(30, 40))
    store = LmdbStore(path, None)
    store.compact_and_close()
    assert (path / "data.mdb").stat().st_size < before
    assert not (path / ".compact.tmp").exists()
    with LmdbStore(path, None) as store:
        assert all(same(store.get(key(i)), record(i, 20_000)) for i in range(30, 40))
        put(store, 99)


# ---------------------------------------------------------------- crashes


def load_crash_writer():
    path = REPO / "benchmarks" / "crash_writer.py"
    spec = importlib.util.spec_from_file_location("crash_writer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["crash_writer"] = module
    spec.loader.exec_module(module)
    return module


def test_writer_killed_at_random_moments(tmp_path: Path) -> None:
    crash_writer = load_crash_writer()
    results = crash_writer.run_rounds(tmp_path, 40, seed=20240501, rounds_per_store=8)
    assert [r.problems for r in results if r.problems] == []
    assert sum(r.killed for r in results) >= 30
    assert sum(r.flushed is not None for r in results) >= 10


# ---------------------------------------------------------------- a damaged data file


def damage_meta(field_offset: int) -> Callable[[Path], None]:
    """Overwrite four bytes of meta page 0 (16: magic, 20: version)."""

    def damage(data: Path) -> None:
        with open(data, "r+b") as f:
            f.seek(field_offset)
            f.write(b"\xff\xff\xff\x7f")

    return damage


def truncate_to(fraction: float) -> Callable[[Path], None]:
    def damage(data: Path) -> None:
        os.truncate(data, int(data.stat().st_size * fraction) // 4096 * 4096 + 10)

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


def leak_past_the_last_page(path: Path, count: int) -> int:
    """Move the committed meta's last page ``count`` pages on, the file grown to hold them:
    pages that nothing claims, as a lost commit could leave. Returns the old last page."""
    with open(path / "data.mdb", "r+b") as f:
        tails = []
        for page in (0, 1):
            f.seek(page * 4096 + 136)
            tails.append(struct.unpack("=QQ", f.read(16)))  # last page, txnid
        newest = max((0, 1), key=lambda page: tails[page][1])
        last = tails[newest][0]
        f.seek(newest * 4096 + 136)
        f.write(struct.pack("=Q", last + count))
        f.truncate(max(os.fstat(f.fileno()).st_size, (last + count + 1) * 4096))
    return last


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


# ---------------------------------------------------------------- a full or failing disk


class FailingDisk:
    """Makes the store's write commits fail as LMDB does on a full or failing disk.

    ``room`` bytes of records fit; a commit that would leave more raises ``error``
    (``room=None``: every write commit fails). Deleting records frees room at once.
    """

    def __init__(self, store: LmdbStore, monkeypatch, error: Exception, room: int | None) -> None:
        self.error, self.room = error, room
        self.records = store._dbs[b"records"]
        self.on_disk = store.stats().bytes_used
        self.failed = 0
        env = store._env
        disk = self

        class Txn:
            def __init__(self, txn) -> None:
                self.txn, self.delta = txn, 0

            def __getattr__(self, name):
                return getattr(self.txn, name)

            def __enter__(self):
                self.txn.__enter__()
                return self

            def put(self, k, v, db=None, **kw):
                if db is disk.records:
                    old = self.txn.get(k, db=db)
                    self.delta += len(v) - (len(old) if old is not None else 0)
                return self.txn.put(k, v, db=db, **kw)

            def delete(self, k, db=None, **kw):
                if db is disk.records:
                    old = self.txn.get(k, db=db)
                    self.delta -= len(old) if old is not None else 0
                return self.txn.delete(k, db=db, **kw)

            def __exit__(self, kind, exc, tb):
                if kind is None and disk.full(self.delta):
                    disk.failed += 1
                    self.txn.abort()
                    raise disk.error
                if kind is None:
                    disk.on_disk += self.delta
                return self.txn.__exit__(kind, exc, tb)

        class Env:
            def __getattr__(self, name):
                return getattr(env, name)

            def begin(self, **kw):
                txn = env.begin(**kw)
                return Txn(txn) if kw.get("write") else txn

        monkeypatch.setattr(store, "_env", Env())

    def full(self, delta: int) -> bool:
        return self.room is None or (delta > 0 and self.on_disk + delta > self.room)


def disk_error(code: int) -> lmdb.Error:
    """What py-lmdb raises when ``mdb_txn_commit`` fails with ``code``."""
    kind = lmdb.DiskError if code == errno.ENOSPC else lmdb.Error
    error = kind(f"mdb_txn_commit: {os.strerror(code)}")
    error.code = code
    return error


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
