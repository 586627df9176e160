"""What the LMDB store's tests share: keys and records made from an integer, the store's
path, a writer held before its commit, and a record rewritten behind the store's back."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
import torch

from storage.base import BlockKey
from storage.lmdb_layout import DESCRIPTOR_NAME
from storage.lmdb_store import (
    LmdbStore,
    default_map_size,
)
from storage.record import Record, encode_record
from storage.seal import SealKey


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


def truncate_to(fraction: float) -> Callable[[Path], None]:
    def damage(data: Path) -> None:
        os.truncate(data, int(data.stat().st_size * fraction) // 4096 * 4096 + 10)

    return damage


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

            def cursor(self, db=None):
                return Cursor(self, db) if db is disk.records else self.txn.cursor(db=db)

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

        class Cursor:
            def __init__(self, txn: Txn, db) -> None:
                self.txn, self.cursor = txn, txn.txn.cursor(db=db)

            def __getattr__(self, name):
                return getattr(self.cursor, name)

            def putmulti(self, items, **kw):
                items = list(items)
                for k, v in items:
                    old = self.txn.txn.get(k, db=disk.records)
                    self.txn.delta += len(v) - (len(old) if old is not None else 0)
                return self.cursor.putmulti(items, **kw)

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


def write_old_version(path: Path, version: int) -> None:
    """Turn a store into what store ``version`` (1 or 2) wrote: its shorter meta values
    (24 bytes: no priority; 32: no parent hash) and its version in the info db and the
    descriptor."""
    size = {1: 24, 2: 32}[version]
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:
        meta, info = env.open_db(b"meta", txn=txn), env.open_db(b"info", txn=txn)
        for kb, value in list(txn.cursor(db=meta)):
            txn.put(kb, value[:size], db=meta)
        txn.put(b"version", str(version).encode(), db=info)
    env.close()
    descriptor = path / DESCRIPTOR_NAME
    descriptor.write_text(json.dumps(json.loads(descriptor.read_text()) | {"version": version}))
