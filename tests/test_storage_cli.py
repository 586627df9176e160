from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch
from typer.testing import CliRunner

from storage.base import BlockKey
from storage.codecs import encode_block
from storage.lmdb_store import LmdbStore
from tiered_kv.cli import app

runner = CliRunner()
NS_A = hashlib.sha256(b"model-a").digest()
NS_B = hashlib.sha256(b"model-b").digest()


def key(ns: bytes, i: int) -> BlockKey:
    return BlockKey(ns, hashlib.sha256(f"{i}".encode()).digest())


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
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


def test_init_creates_then_describes(tmp_path: Path):
    path = tmp_path / "new"
    first = run("init", path, "--size", "64MiB", "--json")
    assert first.exit_code == 0, first.output
    assert json.loads(first.output)["capacity_bytes"] == 64 << 20
    assert (path / "tiered_kv.json").exists() and path.stat().st_mode & 0o777 == 0o700
    again = run("init", path, "--size", "1GiB")
    assert again.exit_code == 0 and "exists" in again.output


def test_stats_json(store_dir: Path):
    result = run("stats", store_dir, "--json")
    assert result.exit_code == 0, result.output
    fields = json.loads(result.output)
    assert fields["entries"] == 8 and fields["bytes_used"] > 0 and fields["quarantined"] == 0


def test_ls_groups_by_namespace(store_dir: Path):
    result = run("ls", store_dir, "--json")
    assert result.exit_code == 0, result.output
    rows = {r["namespace"]: r for r in json.loads(result.output)}
    assert rows[NS_A.hex()]["blocks"] == 5 and rows[NS_A.hex()]["codecs"] == ["zstd"]
    assert rows[NS_B.hex()]["blocks"] == 3 and rows[NS_B.hex()]["dtypes"] == ["bfloat16"]
    table = run("ls", store_dir)
    assert table.exit_code == 0 and NS_A.hex()[:16] in table.output


def test_verify_clean_store_exits_zero(store_dir: Path):
    result = run("verify", store_dir, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ok"] == 8


def test_verify_quarantines_and_exits_one(store_dir: Path):
    env = lmdb.open(str(store_dir), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"records")) as txn:
        kb = key(NS_A, 2).to_bytes()
        bad = bytearray(txn.get(kb))
        bad[len(bad) // 2] ^= 0x10
        txn.put(kb, bytes(bad))
    env.close()
    result = run("verify", store_dir, "--json")
    assert result.exit_code == 1, result.output
    fields = json.loads(result.output)
    assert (fields["corrupt"], fields["quarantined"], fields["ok"]) == (1, 1, 7)
    assert run("verify", store_dir).exit_code == 0  # moved aside: the store is clean now
    assert json.loads(run("stats", store_dir, "--json").output)["quarantined"] == 1


def test_read_only_commands_work_while_a_server_holds_the_store(store_dir: Path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_STORE, str(store_dir)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        assert run("stats", store_dir, "--json").exit_code == 0
        assert run("ls", store_dir, "--json").exit_code == 0
        result = run("verify", store_dir, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["readonly"] is True
    finally:
        holder.communicate("done\n", timeout=30)
    assert holder.returncode == 0


HOLD_STORE = """
import sys
from storage.lmdb_store import LmdbStore
with LmdbStore(sys.argv[1], None):
    print("open", flush=True)
    sys.stdin.readline()
"""


@pytest.mark.parametrize(
    "args, message",
    [
        (("stats", "/nonexistent/kv"), "no such KV cache directory"),
        (("init", "{tmp}/x", "--size", "lots"), "not a size"),
        (("verify", "{tmp}"), "not a tiered-kv disk store"),
    ],
)
def test_errors_are_one_line_and_exit_two(tmp_path: Path, args, message):
    (tmp_path / "stray-file").write_text("not a store")
    result = run(*(a.format(tmp=tmp_path) for a in args))
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
