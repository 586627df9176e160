"""``tiered-kv storage`` commands that inspect the prefix tree or change a store:
tree, gc, compact, export, import, clear."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
import torch
from typer.testing import CliRunner

from engine.hashing import block_hash
from storage.base import BlockKey
from storage.codecs import encode_block
from storage.lmdb_meta import pack_meta, unpack_meta
from storage.lmdb_store import LmdbStore
from storage.record import SEAL_SIZE
from storage.seal import KEY_FILE_NAME, load_key_file
from tiered_kv.archive import ArchiveWriter
from tiered_kv.cli import app

runner = CliRunner()
NS_A = hashlib.sha256(b"model-a").digest()
NS_B = hashlib.sha256(b"model-b").digest()
KV = torch.randn(2, 2, 16, 2, 8, generator=torch.Generator().manual_seed(0)).half()
DAY_NS = 86400 * 10**9


def tokens(text: str) -> list[int]:
    return list(text.encode().ljust(16)[:16])


def chain_keys(ns: bytes, texts: list[str]) -> list[BlockKey]:
    """The keys :func:`put_chain` gives a chain of ``texts`` from a root."""
    keys, parent = [], None
    for text in texts:
        parent = block_hash(parent or ns, tokens(text))
        keys.append(BlockKey(ns, parent))
    return keys


def put_chain(store: LmdbStore, ns: bytes, texts: list[str], parent: bytes | None = None) -> list[bytes]:
    hashes = []
    for text in texts:
        ids = tokens(text)
        h = block_hash(parent or ns, ids)
        key = BlockKey(ns, h)
        store.put(key, encode_block(key, parent, ids, KV, "zstd"))
        hashes.append(h)
        parent = h
    return hashes


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """Namespace A: a chain that branches after two blocks, plus a second root.
    Namespace B: one chain of three blocks."""
    path = tmp_path / "kv"
    with LmdbStore(path, 64 << 20) as store:
        trunk = put_chain(store, NS_A, ["You are a helpf", "ul assistant. "])
        put_chain(store, NS_A, ["Be brief."], trunk[-1])
        put_chain(store, NS_A, ["Be bold.", "And loud."], trunk[-1])
        put_chain(store, NS_A, ["another root"])
        put_chain(store, NS_B, ["b0", "b1", "b2"])
    return path


def run(*args: str, input: str | None = None):
    return runner.invoke(app, ["storage", *map(str, args)], input=input)


def ok_json(*args: str):
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def records(path: Path) -> dict[BlockKey, bytes]:
    with LmdbStore(path, readonly=True) as store:
        return dict(store.raw_records())


def unsealed(path: Path) -> dict[BlockKey, bytes]:
    """The records of ``path`` without their seals, after checking that they carry the
    store's own key id: what an import must keep byte for byte while it re-seals."""
    key_id = load_key_file(path / KEY_FILE_NAME).key_id
    found = records(path)
    assert all(data[-SEAL_SIZE:][: len(key_id)] == key_id for data in found.values())
    return {key: data[:-SEAL_SIZE] for key, data in found.items()}


def set_access_times(path: Path, when_ns: dict[bytes, int]) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        for kb, ns in when_ns.items():
            meta = unpack_meta(txn.get(kb))
            txn.put(kb, pack_meta(ns, meta.nbytes, meta.created_ns, meta.priority, meta.parent_hash))
    env.close()


def test_all_commands_are_listed_in_the_module_docstring():
    import tiered_kv.storage_cli as cli

    for command in ("tree", "inspect", "gc", "evict", "compact", "export", "import", "clear"):
        assert command in cli.__doc__


# ---------------------------------------------------------------------------- tree


def test_tree_rebuilds_chains_and_branches(store_dir: Path):
    (a,) = ok_json("tree", store_dir, "--namespace", NS_A.hex()[:8])
    assert (a["namespace"], a["blocks"], a["roots"], a["unreadable"]) == (NS_A.hex(), 6, 2, 0)
    by_hash = {n["hash"]: n for n in a["nodes"]}
    positions = sorted(n["position"] for n in a["nodes"])
    assert positions == [0, 0, 1, 2, 2, 3]
    branch = next(n for n in a["nodes"] if n["children"] == 2)
    assert branch["position"] == 1 and by_hash[branch["parent"]]["position"] == 0
    assert all(n["parent_stored"] for n in a["nodes"])
    assert {n["codec"] for n in a["nodes"]} == {"zstd"}


def test_tree_depth_and_text(store_dir: Path):
    (a,) = ok_json("tree", store_dir, "-n", NS_A.hex(), "--depth", "2", "--tokenizer", "tiny")
    assert max(n["position"] for n in a["nodes"]) == 1
    assert sum(n["hidden_below"] for n in a["nodes"]) == 3
    assert {n["text"] for n in a["nodes"]} == {"You are a helpf ", "ul assistant.   ", "another root    "}
    table = run("inspect", store_dir, "--tokenizer", "tiny")
    assert table.exit_code == 0, table.output
    assert "'Be bold.        '" in table.stdout and NS_B.hex()[:16] in table.stdout


def test_tree_marks_blocks_whose_parent_is_gone(store_dir: Path):
    first = block_hash(NS_B, tokens("b0"))
    with LmdbStore(store_dir) as store:
        store.delete(BlockKey(NS_B, first))
    (b,) = ok_json("tree", store_dir, "-n", NS_B.hex())
    assert b["roots"] == 1 and [n["parent_stored"] for n in b["nodes"]] == [False, True]
    assert "parent not stored" in run("tree", store_dir, "-n", NS_B.hex()).stdout


def test_tree_errors(store_dir: Path, tmp_path: Path):
    unused = next(d for d in "0123456789abcdef" if d not in (NS_A.hex()[0], NS_B.hex()[0]))
    assert "no namespace starting with" in run("tree", store_dir, "-n", unused).output
    assert run("tree", store_dir, "-n", "xyz").exit_code == 2
    result = run("tree", store_dir, "--tokenizer", tmp_path)
    assert result.exit_code == 2 and "cannot load a tokenizer" in result.output


# ---------------------------------------------------------------------------- gc


def test_gc_older_than_uses_last_access(store_dir: Path):
    now = time.time_ns()
    old = {k.to_bytes(): now - 10 * DAY_NS for k in records(store_dir) if k.namespace == NS_B}
    set_access_times(store_dir, old)
    dry = ok_json("gc", store_dir, "--older-than", "7d", "--dry-run")
    assert (dry["would_evict_blocks"], dry["remaining_blocks"]) == (3, 6)
    assert len(records(store_dir)) == 9  # a dry run changes nothing
    done = ok_json("evict", store_dir, "--older-than", "7d")
    assert done["evicted_blocks"] == 3
    assert {k.namespace for k in records(store_dir)} == {NS_A}


def test_gc_max_size_evicts_chain_ends_first_least_recently_used_first(store_dir: Path):
    """As the server evicts: namespace B's chain keeps its start, used longer ago than its
    end and than every block of namespace A, whose blocks all go first."""
    b0, b1, b2 = (k.to_bytes() for k in chain_keys(NS_B, ["b0", "b1", "b2"]))
    keys = sorted(records(store_dir))
    set_access_times(
        store_dir, {k.to_bytes(): i + 10 for i, k in enumerate(keys)} | {b0: 1, b1: 2, b2: 10**18}
    )
    sizes = {k.to_bytes(): len(data) for k, data in records(store_dir).items()}
    limit = sizes[b0] + sizes[b1] + 10
    done = ok_json("gc", store_dir, "--max-size", str(limit))
    assert done["evicted_blocks"] == 7 and done["remaining_bytes"] == sizes[b0] + sizes[b1]
    assert sorted(k.to_bytes() for k in records(store_dir)) == sorted([b0, b1])


def test_gc_max_size_evicts_the_highest_priority_value_first(store_dir: Path):
    gold = [k for k in records(store_dir) if k.namespace == NS_B]
    with LmdbStore(store_dir) as store:  # a tenant that matters more, put again at -1
        assert store.put_many([(k, store.get(k)) for k in gold], priorities=[-1] * len(gold))
    keys = sorted(records(store_dir), key=lambda k: k not in gold)  # gold: least recently used
    set_access_times(store_dir, {k.to_bytes(): i + 1 for i, k in enumerate(keys)})
    limit = sum(len(data) for k, data in records(store_dir).items() if k in gold)
    done = ok_json("gc", store_dir, "--max-size", str(limit))
    assert done["evicted_blocks"] == 6 and done["remaining_bytes"] == limit
    assert sorted(records(store_dir)) == sorted(gold)


@pytest.mark.parametrize(
    "args, message",
    [
        (("gc", "{dir}"), "say what to evict"),
        (("gc", "{dir}", "--older-than", "soon"), "not a duration"),
        (("gc", "{dir}", "--max-size", "big"), "not a size"),
        (("gc", "/nonexistent/kv", "--max-size", "1MiB"), "no such KV cache directory"),
    ],
)
def test_gc_errors(store_dir: Path, args, message):
    result = run(*(a.format(dir=store_dir) for a in args))
    assert result.exit_code == 2 and message in result.output, result.output


# ---------------------------------------------------------------------------- compact


def test_compact_in_place_keeps_every_record(store_dir: Path):
    before = records(store_dir)
    with LmdbStore(store_dir) as store:  # free some pages
        store.delete_many([k for k in before if k.namespace == NS_B])
    fields = ok_json("compact", store_dir)
    assert fields["bytes_after"] <= fields["bytes_before"]
    assert records(store_dir) == {k: v for k, v in before.items() if k.namespace == NS_A}
    assert ok_json("verify", store_dir)["ok"] == 6
    with LmdbStore(store_dir) as store:  # still writable, with its budget
        assert store.capacity_bytes == 64 << 20
        put_chain(store, NS_B, ["again"])
    assert len(records(store_dir)) == 7


def no_room(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("failure", [no_room, interrupt])
def test_a_failed_compaction_removes_its_partial_copy(store_dir: Path, tmp_path: Path, monkeypatch, failure):
    """A full disk or Ctrl-C midway: the copy would hold the room the store needs (all of
    it, on a full disk); the store is as it was."""
    import storage.lmdb_admin

    before = records(store_dir)
    monkeypatch.setattr(storage.lmdb_admin, "make_file_private", failure)
    result = run("compact", store_dir)
    assert result.exit_code == (2 if failure is no_room else 130), result.output
    assert not (store_dir / ".compact.tmp").exists()
    result = run("compact", store_dir, "--output", tmp_path / "copy")
    assert result.exit_code == (2 if failure is no_room else 130), result.output
    assert not (tmp_path / "copy").exists()
    monkeypatch.undo()
    assert records(store_dir) == before and ok_json("verify", store_dir)["ok"] == 9


def test_compact_to_output(store_dir: Path, tmp_path: Path):
    out = tmp_path / "copy"
    fields = ok_json("compact", store_dir, "--output", out)
    assert fields["output"] == str(out)
    assert records(out) == records(store_dir)
    assert out.stat().st_mode & 0o777 == 0o700
    again = run("compact", store_dir, "--output", out)
    assert again.exit_code == 2 and "exists" in again.output


# ---------------------------------------------------------------------------- export / import


@pytest.mark.parametrize("compress", [False, True])
def test_export_import_round_trip_is_byte_exact(store_dir: Path, tmp_path: Path, compress: bool):
    archive = tmp_path / "kv.tkv"
    flags = ["--compress"] if compress else []
    exported = ok_json("export", store_dir, archive, *flags)
    assert exported["records"] == 9 and exported["skipped_corrupt"] == 0
    imported = ok_json("import", archive, tmp_path / "restored", "--size", "32MiB",
                       "--key-file", store_dir / KEY_FILE_NAME)
    assert (imported["created"], imported["imported"], imported["skipped_corrupt"]) == (True, 9, 0)
    assert unsealed(tmp_path / "restored") == unsealed(store_dir)  # re-sealed, else the same
    with LmdbStore(tmp_path / "restored", readonly=True) as store:
        assert store.capacity_bytes == 32 << 20


def test_exported_archives_are_private(store_dir: Path, tmp_path: Path):
    umask = os.umask(0o022)  # what most shells have: 0644 for a plain open()
    try:
        ok_json("export", store_dir, tmp_path / "kv.tkv", "--compress")
        stale = tmp_path / ".again.tkv.tmp"  # the leftover of an export cut short
        stale.write_bytes(b"partial")
        ok_json("export", store_dir, tmp_path / "again.tkv")
    finally:
        os.umask(umask)
    for name in ("kv.tkv", "again.tkv"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    assert not stale.exists()


def test_export_one_namespace_into_an_existing_store(store_dir: Path, tmp_path: Path):
    archive = tmp_path / "b.tkv"
    assert ok_json("export", store_dir, archive, "-n", NS_B.hex()[:6])["records"] == 3
    target = tmp_path / "other"
    with LmdbStore(target, 16 << 20) as store:
        put_chain(store, NS_A, ["kept"])
    assert ok_json("import", archive, target, "--key-file", store_dir / KEY_FILE_NAME)["imported"] == 3
    assert len(records(target)) == 4
    assert run("export", store_dir, archive).exit_code == 2  # never overwrites


def test_export_leaves_out_corrupt_records(store_dir: Path, tmp_path: Path):
    env = lmdb.open(str(store_dir), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"records")) as txn:
        kb, value = next(iter(txn.cursor()))
        bad = bytearray(value)
        bad[len(bad) // 2] ^= 1
        txn.put(kb, bytes(bad))
    env.close()
    fields = ok_json("export", store_dir, tmp_path / "a.tkv")
    assert (fields["records"], fields["skipped_corrupt"]) == (8, 1)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_import_refuses_a_damaged_archive_and_writes_nothing(store_dir: Path, tmp_path: Path, damage: str):
    archive = tmp_path / "kv.tkv"
    ok_json("export", store_dir, archive)
    data = bytearray(archive.read_bytes())
    if damage == "truncate":
        data = data[: len(data) * 2 // 3]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = bytearray(b"this is not an archive at all")
    archive.write_bytes(bytes(data))
    target = tmp_path / "target"
    result = run("import", archive, target)
    assert result.exit_code == 2 and "nothing imported" in result.output, result.output
    assert "Traceback" not in result.output and not target.exists()


def test_import_skips_records_that_fail_verification(tmp_path: Path, store_dir: Path):
    good = records(store_dir)
    archive = tmp_path / "mixed.tkv"
    with open(archive, "wb") as f:
        writer = ArchiveWriter(f, load_key_file(store_dir / KEY_FILE_NAME).key_id)
        items = list(good.items())
        for key, data in items[:5]:
            writer.add(key, data)
        tampered = bytearray(items[5][1])
        tampered[200] ^= 1
        writer.add(items[5][0], bytes(tampered))  # a MAC mismatch
        writer.add(items[6][0], items[7][1])  # a record under another key
        writer.finish()
    fields = ok_json("import", archive, tmp_path / "t", "--key-file", store_dir / KEY_FILE_NAME)
    assert (fields["records"], fields["imported"], fields["skipped_corrupt"]) == (7, 5, 2)
    assert fields["skipped_by_reason"] == {"key": 1, "mac": 1}
    assert unsealed(tmp_path / "t") == {k: d[:-SEAL_SIZE] for k, d in items[:5]}


def test_a_record_the_archive_holds_twice_is_imported_and_counted_once(tmp_path: Path, store_dir: Path):
    """Both copies fell in one batch of puts, and each was counted as imported."""
    items = list(records(store_dir).items())
    archive = tmp_path / "twice.tkv"
    with open(archive, "wb") as f:
        writer = ArchiveWriter(f, load_key_file(store_dir / KEY_FILE_NAME).key_id)
        for key, data in (items[0], items[1], items[0]):
            writer.add(key, data)
        writer.finish()
    fields = ok_json("import", archive, tmp_path / "t", "--key-file", store_dir / KEY_FILE_NAME)
    assert (fields["records"], fields["imported"], fields["already_present"]) == (3, 2, 1)
    assert unsealed(tmp_path / "t") == {k: d[:-SEAL_SIZE] for k, d in items[:2]}


def test_import_errors(tmp_path: Path, store_dir: Path):
    missing = run("import", tmp_path / "none.tkv", tmp_path / "t")
    assert missing.exit_code == 2 and "no such archive" in missing.output
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "file").write_text("x")
    archive = tmp_path / "a.tkv"
    ok_json("export", store_dir, archive)
    not_store = run("import", archive, tmp_path / "stray", "--key-file", store_dir / KEY_FILE_NAME)
    assert not_store.exit_code == 2 and "not a tiered-kv disk store" in not_store.output


def test_an_archive_under_another_key_is_refused_before_its_body_is_read(tmp_path: Path, store_dir: Path, monkeypatch):
    """The header's key id is checked first: a crafted body (here one record whose own header
    claims 200 MiB of zstd-compressed zeros) is never expanded for a key not at hand."""
    import struct

    import zstandard

    from storage.record import FORMAT_VERSION, MAGIC
    from tiered_kv import archive as tkv_archive

    forged = tmp_path / "forged.tkv"
    head = struct.pack("<4sHHIQ", MAGIC, FORMAT_VERSION, 0, 0, (200 << 20) - SEAL_SIZE)
    body = struct.pack("<I", 200 << 20) + bytes(64) + head + bytes((200 << 20) - len(head))
    forged.write_bytes(
        struct.pack("<8sHH", tkv_archive.MAGIC, tkv_archive.VERSION, tkv_archive.FLAG_ZSTD)
        + bytes(8) + zstandard.ZstdCompressor().compress(body)
    )
    from tiered_kv import storage_transfer

    read = []
    monkeypatch.setattr(storage_transfer, "check_archive", lambda *a, **k: read.append(a))
    result = run("import", forged, store_dir)
    assert result.exit_code == 2 and "is sealed under key 0000000000000000" in result.output
    assert read == []  # the body was never read


# ---------------------------------------------------------------------------- clear


def test_clear_deletes_one_namespace(store_dir: Path):
    fields = ok_json("clear", store_dir, "--namespace", NS_B.hex(), "--yes")
    assert fields["deleted_blocks"] == 3
    assert {k.namespace for k in records(store_dir)} == {NS_A}


def test_clear_asks_first(store_dir: Path):
    declined = run("clear", store_dir, "-n", NS_B.hex()[:10], input="n\n")
    assert declined.exit_code == 1 and len(records(store_dir)) == 9
    assert declined.stdout == "" and "Delete 3 blocks" in declined.stderr  # the prompt: stderr
    unanswered = run("clear", store_dir, "-n", NS_B.hex()[:10], "--json", input="")  # stdin closed
    assert unanswered.exit_code == 1 and len(records(store_dir)) == 9
    assert json.loads(unanswered.stdout) == {
        "namespace": NS_B.hex(), "deleted_blocks": 0, "deleted_bytes": 0, "declined": True,
    }
    accepted = run("clear", store_dir, "-n", NS_B.hex()[:10], "--json", input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert accepted.stdout.startswith("{") and json.loads(accepted.stdout)["deleted_blocks"] == 3
    assert len(records(store_dir)) == 6


def test_clear_needs_a_known_namespace(store_dir: Path):
    result = run("clear", store_dir, "-n", "", "--yes")
    assert result.exit_code == 2
    common = ""
    for x, y in zip(NS_A.hex(), NS_B.hex()):
        if x != y:
            break
        common += x
    if common:
        ambiguous = run("clear", store_dir, "-n", common, "--yes")
        assert ambiguous.exit_code == 2 and "give more digits" in ambiguous.output


# ---------------------------------------------------------------------------- with a server


HOLD_STORE = """
import sys
from storage.lmdb_store import LmdbStore
with LmdbStore(sys.argv[1], None):
    print("open", flush=True)
    sys.stdin.readline()
"""


def test_writing_commands_refuse_a_held_store_and_reading_ones_work(store_dir: Path, tmp_path: Path):
    archive = tmp_path / "a.tkv"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_STORE, str(store_dir)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        for args in (
            ("gc", store_dir, "--max-size", "1KiB"),
            ("clear", store_dir, "-n", NS_A.hex(), "--yes"),
            ("compact", store_dir),
            ("import", archive, store_dir),
        ):
            if args[0] == "import":
                ok_json("export", store_dir, archive)  # export reads while the server writes
            result = run(*args)
            assert result.exit_code == 2, (args, result.output)
            assert "held by a running server (by pid" in result.output, result.output
            assert "Traceback" not in result.output
        assert ok_json("gc", store_dir, "--max-size", "1KiB", "--dry-run")["would_evict_blocks"] == 9
        assert ok_json("tree", store_dir)[0]["blocks"] in (6, 3)
        ok_json("compact", store_dir, "--output", tmp_path / "snapshot")
        assert len(records(tmp_path / "snapshot")) == 9
    finally:
        holder.communicate("done\n", timeout=30)
    assert holder.returncode == 0
    assert len(records(store_dir)) == 9
