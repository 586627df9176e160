"""Shared by the ``tiered-kv storage`` CLI tests: a small store of two namespaces, and the
CLI invoked in-process."""
from __future__ import annotations

import hashlib
from pathlib import Path

import lmdb
import torch
from typer.testing import CliRunner

from storage.base import BlockKey
from storage.codecs import encode_block
from storage.lmdb_store import LmdbStore
from storage.record import SEAL_SIZE
from tiered_kv.cli import app

runner = CliRunner()
NS_A = hashlib.sha256(b"model-a").digest()
NS_B = hashlib.sha256(b"model-b").digest()


def key(ns: bytes, i: int) -> BlockKey:
    return BlockKey(ns, hashlib.sha256(f"{i}".encode()).digest())


def small_store(tmp_path: Path) -> Path:
    """Five zstd blocks of namespace A and three kivi4 blocks of namespace B."""
    path = tmp_path / "kv"
    kv = torch.randn(2, 2, 16, 2, 8, generator=torch.Generator().manual_seed(0))
    with LmdbStore(path, 64 << 20) as store:
        for i in range(5):
            store.put(key(NS_A, i), encode_block(key(NS_A, i), None, range(16), kv.half(), "zstd"))
        for i in range(3):
            store.put(key(NS_B, i), encode_block(key(NS_B, i), None, range(16), kv.bfloat16(), "kivi4"))
    return path


def run(*args: str):
    return runner.invoke(app, ["storage", *map(str, args)])


# A process that holds a store as a server does (the writer lock) until its stdin has a line.
HOLD_STORE = """
import sys
from storage.lmdb_store import LmdbStore
with LmdbStore(sys.argv[1], None):
    print("open", flush=True)
    sys.stdin.readline()
"""


def stored(path: Path, k: BlockKey, change=None) -> bytes:
    """The bytes stored under ``k``, rewritten first by ``change`` behind the store's back."""
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=change is not None, db=env.open_db(b"records")) as txn:
        data = bytes(txn.get(k.to_bytes()))
        if change is not None:
            data = change(bytearray(data))
            txn.put(k.to_bytes(), data)
    env.close()
    return data


def forge(buf: bytearray) -> bytes:
    """Altered KV under a recomputed unkeyed checksum (xxh3-64, the last eight bytes)."""
    import xxhash

    buf[len(buf) - SEAL_SIZE - 1] ^= 0x55
    buf[-8:] = xxhash.xxh3_64_intdigest(bytes(buf[:-8])).to_bytes(8, "little")
    return bytes(buf)


def other_store(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    LmdbStore(path, 16 << 20).close()
    return path
