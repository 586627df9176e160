"""Corrupt records in the LMDB store: a miss, never served, quarantined; verify and the
store's private seal key."""
from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from storage.base import BlockKey, StoreError
from storage.lmdb_store import (
    DESCRIPTOR_NAME,
    LmdbStore,
)
from storage.record import SEAL_SIZE, RecordError, decode_record, encode_record
from storage.seal import KEY_FILE_NAME, load_key_file

from lmdb_testing import corrupt_stored, flip, key, put, record, same
from lmdb_testing import path  # noqa: F401  (a fixture)


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
