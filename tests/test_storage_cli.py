from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch
from typer.testing import CliRunner

from storage.base import BlockKey, StoreError
from storage.codecs import encode_block
from storage.lmdb_store import LmdbStore
from storage.record import SEAL_SIZE
from storage.seal import KEY_FILE_NAME, load_key_file
from lmdb_testing import leak_past_the_last_page
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
    assert json.loads(first.stdout)["capacity_bytes"] == 64 << 20
    assert (path / "tiered_kv.json").exists() and path.stat().st_mode & 0o777 == 0o700
    again = run("init", path)
    assert again.exit_code == 0 and "exists" in again.output


def test_init_size_resizes_an_existing_store(store_dir: Path):
    grown = run("init", store_dir, "--size", "1GiB", "--json")
    assert grown.exit_code == 0, grown.output
    fields = json.loads(grown.stdout)
    assert (fields["created"], fields["resized_from"], fields["evicted_blocks"]) == (False, 64 << 20, 0)
    assert fields["capacity_bytes"] == 1 << 30 and fields["entries"] == 8
    assert fields["map_size"] >= 2 << 30  # room for the larger budget
    one_block = json.loads(run("stats", store_dir, "--json").stdout)["bytes_used"] // 8
    shrunk = run("init", store_dir, "--size", str(3 * one_block + 1), "--json")
    assert shrunk.exit_code == 0, shrunk.output
    fields = json.loads(shrunk.stdout)
    assert fields["evicted_blocks"] >= 5 and fields["entries"] == 8 - fields["evicted_blocks"]
    stats = json.loads(run("stats", store_dir, "--json").stdout)
    assert stats["capacity_bytes"] == 3 * one_block + 1 and stats["entries"] == fields["entries"]
    text = " ".join(run("init", store_dir, "--size", "2GiB").output.split())
    assert "to 2.0 GiB; 0 blocks evicted" in text


def test_init_size_refuses_a_store_a_server_holds(store_dir: Path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_STORE, str(store_dir)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        result = run("init", store_dir, "--size", "1GiB")
        assert result.exit_code == 2 and "held by a running server" in result.output
        assert len(result.output.strip().splitlines()) == 1
        assert run("init", store_dir).exit_code == 0  # describing it needs no lock
    finally:
        holder.communicate("done\n", timeout=30)
    assert json.loads(run("stats", store_dir, "--json").stdout)["capacity_bytes"] == 64 << 20


def test_stats_json(store_dir: Path):
    result = run("stats", store_dir, "--json")
    assert result.exit_code == 0, result.output
    fields = json.loads(result.stdout)
    assert fields["entries"] == 8 and fields["bytes_used"] > 0 and fields["quarantined"] == 0


def test_ls_groups_by_namespace(store_dir: Path):
    result = run("ls", store_dir, "--json")
    assert result.exit_code == 0, result.output
    rows = {r["namespace"]: r for r in json.loads(result.stdout)}
    assert rows[NS_A.hex()]["blocks"] == 5 and rows[NS_A.hex()]["codecs"] == ["zstd"]
    assert rows[NS_B.hex()]["blocks"] == 3 and rows[NS_B.hex()]["dtypes"] == ["bfloat16"]
    table = run("ls", store_dir)
    assert table.exit_code == 0 and NS_A.hex()[:16] in table.output


def test_ls_counts_the_records_it_cannot_read(store_dir: Path):
    for i in range(3):  # every block of B, and none of A's, fails its seal
        stored(store_dir, key(NS_B, i), forge)
    result = run("ls", store_dir, "--json")
    assert result.exit_code == 0, result.output
    rows = {r["namespace"]: r for r in json.loads(result.stdout)}
    assert (rows[NS_A.hex()]["blocks"], rows[NS_A.hex()]["unreadable"]) == (5, 0)
    assert (rows[NS_B.hex()]["blocks"], rows[NS_B.hex()]["unreadable"]) == (0, 3)
    (line,) = result.stderr.splitlines()
    assert line.startswith("warning: ") and "3 records fail verification" in line
    table = run("ls", store_dir)
    assert table.exit_code == 0 and "3 records fail verification" in table.stderr
    assert NS_B.hex()[:16] in table.stdout


def test_ls_counts_the_blocks_at_each_priority(store_dir: Path):
    with LmdbStore(store_dir) as store:  # two of B's blocks put again by a tenant at -3
        assert store.put_many([(key(NS_B, i), store.get(key(NS_B, i))) for i in (0, 1)],
                              priorities=[-3, -3]) == [True, True]
    result = run("ls", store_dir, "--json")
    assert result.exit_code == 0, result.output
    rows = {r["namespace"]: r for r in json.loads(result.stdout)}
    assert rows[NS_A.hex()]["priorities"] == {"0": 5}
    assert rows[NS_B.hex()]["priorities"] == {"-3": 2, "0": 1}


def test_ls_counts_the_priorities_of_the_listed_blocks_only(store_dir: Path):
    with LmdbStore(store_dir) as store:
        assert store.put_many([(key(NS_B, i), store.get(key(NS_B, i))) for i in (0, 1)],
                              priorities=[-3, -3]) == [True, True]
    stored(store_dir, key(NS_B, 0), forge)  # one block at -3 fails its seal
    stored(store_dir, key(NS_A, 2), forge)
    result = run("ls", store_dir, "--json")
    assert result.exit_code == 0, result.output
    rows = {r["namespace"]: r for r in json.loads(result.stdout)}
    assert rows[NS_A.hex()]["priorities"] == {"0": 4}
    assert rows[NS_B.hex()]["priorities"] == {"-3": 1, "0": 1}
    for row in rows.values():
        assert sum(row["priorities"].values()) == row["blocks"] and row["unreadable"] == 1


def test_verify_clean_store_exits_zero(store_dir: Path):
    result = run("verify", store_dir, "--json")
    assert result.exit_code == 0, result.output
    fields = json.loads(result.stdout)
    assert fields["ok"] == 8 and (fields["leaked_pages"], fields["first_leaked_pages"]) == (0, [])
    assert result.stderr == ""


def test_verify_reports_leaked_pages_as_a_warning_not_damage(big_store: Path):
    """Pages below the last one that nothing claims waste room, harm no record: verify
    counts them, names the first, warns once, and exits 0; the other commands still work."""
    last = leak_past_the_last_page(big_store, 7)
    result = run("verify", big_store, "--json")
    assert result.exit_code == 0, result.output
    fields = json.loads(result.stdout)
    assert (fields["ok"], fields["corrupt"]) == (150, 0)
    assert fields["leaked_pages"] == 7 and fields["first_leaked_pages"] == list(range(last + 1, last + 6))
    (said,) = result.stderr.splitlines()
    assert said.startswith("warning: ") and "7 leaked pages" in said and "`repair`" in said, said
    text = " ".join(run("verify", big_store).stdout.split())
    assert "leaked_pages" in text
    assert f"7 (pages {', '.join(map(str, range(last + 1, last + 6)))}, ...)" in text
    assert run("stats", big_store, "--json").exit_code == 0


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
    fields = json.loads(result.stdout)
    assert (fields["corrupt"], fields["quarantined"], fields["ok"]) == (1, 1, 7)
    (said,) = result.stderr.splitlines()  # what the store logged: one line, on stderr
    assert said.startswith("warning: ") and "corrupt record" in said, result.stderr
    assert run("verify", store_dir).exit_code == 0  # moved aside: the store is clean now
    assert json.loads(run("stats", store_dir, "--json").stdout)["quarantined"] == 1


def test_verify_says_why_it_left_bad_records_in_a_store_it_cannot_write(store_dir: Path, monkeypatch):
    import storage.lmdb_layout

    stored(store_dir, key(NS_A, 2), forge)

    def read_only(path):
        raise StoreError(f"{path} is not writable (a read-only filesystem, or its permissions)")

    monkeypatch.setattr(storage.lmdb_layout, "prepare_directory", read_only)
    result = run("verify", store_dir)
    assert result.exit_code == 1, result.output
    text = " ".join(result.stdout.split())
    assert "server" not in text and "cannot be written" in text and "read-only filesystem" in text


def test_init_completes_a_store_whose_creation_was_cut_short(store_dir: Path):
    """A full disk can stop a creation after the descriptor, before LMDB's first pages:
    the read-only commands say so, and init (which opens an existing store read-only)
    completes it instead of failing the same way."""
    for cut in ("empty", "missing"):
        (store_dir / "data.mdb").unlink()
        if cut == "empty":
            (store_dir / "data.mdb").write_bytes(b"")
        refused = run("stats", store_dir)
        assert refused.exit_code == 2 and "storage init" in refused.stderr, refused.output
        result = run("init", store_dir, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["entries"] == 0
        assert run("verify", store_dir).exit_code == 0


def test_ctrl_c_is_one_line_and_exit_130_and_keeps_what_was_committed(store_dir: Path, tmp_path: Path, monkeypatch):
    archive = tmp_path / "a.tkv"
    assert run("export", store_dir, archive).exit_code == 0
    put_many, calls = LmdbStore.put_many, []

    def interrupted(self, items, **kwargs):
        calls.append(len(items))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return put_many(self, items, **kwargs)

    monkeypatch.setattr("tiered_kv.storage_transfer.PUT_BATCH", 3)
    monkeypatch.setattr(LmdbStore, "put_many", interrupted)
    target = tmp_path / "copy"
    for as_json in (False, True):
        calls.clear()
        args = ["import", archive, target, "--key-file", store_dir / KEY_FILE_NAME]
        result = run(*args, *(["--json"] if as_json else []))
        assert result.exit_code == 130, result.output
        if as_json:
            assert json.loads(result.stdout) == {"error": "interrupted"} and result.stderr == ""
        else:
            assert result.stdout == "" and result.stderr == "error: interrupted\n"
    monkeypatch.undo()
    fields = json.loads(run("verify", target, "--json").stdout)
    assert (fields["checked"], fields["corrupt"]) == (6, 0)  # the first batch of each, committed


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
        fields = json.loads(result.stdout)
        assert fields["readonly"] is True and fields["leaked_pages"] == 0
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
        (("stats",), "Missing argument 'DIR'"),
        (("nosuch", "{tmp}"), "No such command 'nosuch'"),
        (("tree", "{tmp}", "--depth", "0"), "Invalid value for '--depth'"),
        (("stats", "{tmp}", "--bogus"), "No such option: --bogus"),
    ],
)
def test_errors_are_one_line_and_exit_two(tmp_path: Path, args, message):
    (tmp_path / "stray-file").write_text("not a store")
    result = run(*(a.format(tmp=tmp_path) for a in args))
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert result.stdout == "" and result.stderr.startswith("error: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("stats", "/nonexistent/kv", "--json"), "/nonexistent/kv: no such KV cache directory"),
        (("gc", "{tmp}", "--json"), "say what to evict"),
        (("stats", "--json"), "Missing argument"),
        (("tree", "{tmp}", "--depth", "0", "--json"), "'--depth'"),
        (("ls", "{tmp}", "--json", "--bogus"), "No such option: --bogus"),
    ],
)
def test_with_json_an_error_is_one_json_object_on_stdout(tmp_path: Path, args, message):
    result = run(*(a.format(tmp=tmp_path) for a in args))
    assert result.exit_code == 2 and result.stderr == ""
    (line,) = result.stdout.splitlines()
    assert set(json.loads(line)) == {"error"} and message in json.loads(line)["error"]


def test_a_failing_disk_or_an_unexpected_exception_is_one_line(store_dir: Path, monkeypatch):
    def eio(self):
        raise OSError(errno.EIO, "Input/output error", str(self.path / "data.mdb"))

    monkeypatch.setattr(LmdbStore, "info", eio)
    result = run("stats", store_dir)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == f"error: {store_dir / 'data.mdb'}: Input/output error\n"

    def bug(self):
        raise KeyError("entries")

    monkeypatch.setattr(LmdbStore, "info", bug)
    result = run("stats", store_dir, "--json")
    assert result.exit_code == 3 and result.stderr == ""
    assert json.loads(result.stdout) == {"error": "internal error: KeyError: 'entries'"}


# ---------------------------------------------------------------- a damaged data file

REPO = Path(__file__).resolve().parents[1]

ON_DAMAGE = r"""
import json, os, random, shutil, struct, sys
from typer.testing import CliRunner
from tiered_kv.cli import app

source, work, kind = sys.argv[1:4]
data = open(os.path.join(source, "data.mdb"), "rb").read()
size, pages = len(data), range(2, len(data) // 4096)
tree_pages = [p for p in pages if struct.unpack_from("<H", data, p * 4096 + 10)[0] in (1, 2)]


def write_at(offset, chunk):
    return lambda f: (f.seek(offset), f.write(chunk))


def scribble(seed, where, count, span):
    rng = random.Random(seed)
    spots = [(rng.choice(where) * 4096 + rng.randrange(span), rng.randrange(256))
             for _ in range(count)]
    return lambda f: [(f.seek(at), f.write(bytes([byte]))) for at, byte in spots]


cases = {
    "truncated": [lambda f, n=n: f.truncate(n) for n in (size // 2 + 10, size // 10, 4196, 150)],
    "meta": [
        write_at(16, b"\0\0\0\0"),  # magic of meta page 0
        write_at(4096 + 20, b"\7\0\0\0"),  # version of meta page 1
        write_at(40, b"\3\0\0\0"),  # page size
        lambda f: (write_at(16, b"\1" * 4)(f), write_at(4096 + 16, b"\1" * 4)(f)),
    ],
    "random": [scribble(seed, pages, 64, 4096) for seed in range(3)]  # anywhere
    + [scribble(seed, tree_pages, 8, 64) for seed in range(3, 9)],  # page and node headers
}[kind]
runner = CliRunner()
for i, mutate in enumerate(cases):
    store = os.path.join(work, f"{kind}{i}")
    shutil.copytree(source, store)
    with open(os.path.join(store, "data.mdb"), "r+b") as f:
        mutate(f)
    repaired = store + ".repaired"
    for args in (["verify", store], ["stats", store, "--json"], ["ls", store, "--json"],
                 ["export", store, store + ".tkv"], ["repair", store, "--out", repaired, "--json"],
                 ["verify", repaired, "--json"]):
        print(json.dumps({"case": i, "running": args[0]}), flush=True)  # a signal stops here
        result = runner.invoke(app, ["storage", *args])
        crash = None if isinstance(result.exception, (SystemExit, type(None))) else result.exception
        print(json.dumps({
            "case": i, "command": args[0], "target": args[1], "code": result.exit_code,
            "json": "--json" in args, "output": result.stdout, "stderr": result.stderr,
            "crash": repr(crash) if crash else None,
        }), flush=True)
"""


@pytest.fixture
def big_store(tmp_path: Path) -> Path:
    """Records inline and on overflow pages, enough for branch pages in the records db."""
    path = tmp_path / "big"
    kv = torch.randn(2, 2, 16, 2, 8, generator=torch.Generator().manual_seed(0))
    wide = torch.randn(4, 2, 16, 4, 32, generator=torch.Generator().manual_seed(1))
    with LmdbStore(path, 64 << 20) as store:
        for i in range(150):
            block = (kv if i % 3 else wide).half()
            store.put(key(NS_A, i), encode_block(key(NS_A, i), None, range(16), block, "raw"))
    return path


@pytest.mark.parametrize("kind", ["truncated", "meta", "random"])
def test_no_command_dies_on_a_damaged_data_file(big_store: Path, tmp_path: Path, kind: str):
    work = tmp_path / "work"
    work.mkdir()
    child = subprocess.run(
        [sys.executable, "-c", ON_DAMAGE, str(big_store), str(work), kind],
        capture_output=True, text=True, cwd=REPO, timeout=240,
    )
    assert child.returncode >= 0, f"killed by signal {-child.returncode}: {child.stdout[-800:]}"
    assert child.returncode == 0, child.stderr
    results = [r for r in map(json.loads, child.stdout.splitlines()) if "command" in r]
    assert len(results) == 6 * len({r["case"] for r in results}) >= 24
    for r in results:
        assert r["crash"] is None and "Traceback" not in r["output"] + r["stderr"], r
        # stderr: what the store logged on the way, then the error line if there is one
        said = r["stderr"].strip().splitlines()
        assert all(line.startswith(("warning: ", "error: ")) for line in said), r
        assert r["code"] != 3, r  # an exception the command did not expect
        if r["code"] == 2:
            if r["json"]:  # stdout is the one JSON document
                (line,) = r["output"].strip().splitlines()
                assert json.loads(line)["error"], r
            else:
                assert not r["output"] and said[-1].startswith("error: "), r
        lines = (r["output"] if r["json"] or r["code"] != 2 else r["stderr"]).strip().splitlines()
        if r["code"] == 2 and not r["json"]:
            lines = lines[-1:]  # the error line
        if r["command"] == "repair":
            assert r["code"] == 0, r
        elif r["target"].endswith(".repaired"):
            assert r["code"] == 0 and json.loads(r["output"])["corrupt"] == 0, r
        elif kind != "random":  # the store itself: refused, pointing at repair
            assert r["code"] == 2 and "is damaged" in lines[0] and "storage repair" in lines[0], r
        else:
            assert r["code"] in (0, 1, 2), r


def test_repair_in_place_keeps_the_damaged_store_aside(big_store: Path):
    with LmdbStore(big_store, readonly=True) as store:
        before = dict(store.raw_records())
    data = bytearray((big_store / "data.mdb").read_bytes())
    at = data.find(before[key(NS_A, 6)])  # record 6 rots in place: no good copy is left
    assert at > 0
    data[at + len(before[key(NS_A, 6)]) // 2] ^= 0x10
    (big_store / "data.mdb").write_bytes(bytes(data))
    with open(big_store / "data.mdb", "r+b") as f:
        txnids = []
        for page in (0, 1):
            f.seek(page * 4096 + 144)
            txnids.append(int.from_bytes(f.read(8), "little"))
        f.seek(txnids.index(max(txnids)) * 4096 + 16)
        f.write(b"\0\0\0\0")  # the newest meta page, as a torn write would leave it
    assert run("verify", big_store).exit_code == 2
    result = run("repair", big_store, "--json")
    assert result.exit_code == 0, result.output
    fields = json.loads(result.stdout)
    aside = Path(fields["moved_aside"])
    assert aside.name.startswith("big.damaged-") and (aside / "data.mdb").exists()
    assert fields["output"] == str(big_store) and fields["skipped"] == 1
    with LmdbStore(big_store, readonly=True) as store:
        after = dict(store.raw_records())
    # The other meta page is the snapshot before the last commit; what only the last
    # commit wrote is found by scanning the pages, so nothing readable is lost.
    # Re-sealed under the fresh store's own new key, and otherwise byte for byte the same.
    new_key = load_key_file(big_store / KEY_FILE_NAME)
    assert new_key != load_key_file(aside / KEY_FILE_NAME)
    assert all(v[-SEAL_SIZE:].startswith(new_key.key_id) for v in after.values())
    assert {k: v[:-SEAL_SIZE] for k, v in after.items()} == {
        k: v[:-SEAL_SIZE] for k, v in before.items() if k != key(NS_A, 6)
    }
    assert fields["salvaged"] == len(after)
    assert run("verify", big_store).exit_code == 0


def test_repair_to_another_directory_leaves_the_source(store_dir: Path, tmp_path: Path):
    os.truncate(store_dir / "data.mdb", 3 * 4096)
    source = (store_dir / "data.mdb").read_bytes()
    result = run("repair", store_dir, "--out", tmp_path / "fixed", "--size", "8MiB", "--json")
    assert result.exit_code == 0, result.output
    fields = json.loads(result.stdout)
    assert fields["moved_aside"] is None and fields["output"] == str(tmp_path / "fixed")
    assert fields["problems"] >= 1 and "past the end of the file" in fields["first_problem"]
    assert (store_dir / "data.mdb").read_bytes() == source
    stats = json.loads(run("stats", tmp_path / "fixed", "--json").stdout)
    assert stats["entries"] == fields["salvaged"] and stats["capacity_bytes"] == 8 << 20
    again = run("repair", store_dir, "--out", tmp_path / "fixed")
    assert again.exit_code == 2 and "not empty" in again.output


@pytest.mark.parametrize("target", ["run", "leaf"])
def test_a_value_pointed_at_pages_another_owner_holds_is_damage(big_store: Path, tmp_path: Path, target):
    """One value's node edited to name another value's run, or a leaf page: two owners for
    the same pages. verify refuses the store, naming both; repair salvages the rest."""
    with LmdbStore(big_store, readonly=True) as store:
        raw = dict(store.raw_records())
    data = (big_store / "data.mdb").read_bytes()
    first_page = {k: (data.find(v) - 16) // 4096 for k, v in raw.items() if len(v) > 4096}
    (a, a_page), (b, b_page) = list(first_page.items())[:2]  # same size: one run holds either
    leaf = next(p for p in range(2, len(data) // 4096) if data[p * 4096 + 10] == 0x02)
    node = a.to_bytes() + struct.pack("=Q", a_page)  # the key, then the run's first page
    assert data.count(node) >= 1  # the live leaf, and older copies of it on free pages
    edited = a.to_bytes() + struct.pack("=Q", b_page if target == "run" else leaf)
    (big_store / "data.mdb").write_bytes(data.replace(node, edited))

    problem = {
        "run": f"records db: the overflow run at page {b_page} overlaps page {b_page} of "
        f"the records db's overflow run at page {b_page}",
        "leaf": f"records db: page {leaf} is not the page its link expects",
    }[target]
    result = run("verify", big_store, "--json")
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]
    assert f"is damaged: {problem}" in error and "storage repair" in error, error
    result = run("repair", big_store, "--out", tmp_path / "fixed", "--json")
    assert result.exit_code == 0, result.output
    fields = json.loads(result.stdout)
    assert fields["first_problem"] == problem and fields["salvaged"] >= len(raw) - 1
    with LmdbStore(tmp_path / "fixed", readonly=True) as fixed:
        assert fixed.get(b) is not None
    assert json.loads(run("verify", tmp_path / "fixed", "--json").stdout)["corrupt"] == 0


def test_repair_refuses_a_store_a_server_holds(store_dir: Path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_STORE, str(store_dir)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        result = run("repair", store_dir)
        assert result.exit_code == 2 and "held by a running server" in result.output
    finally:
        holder.communicate("done\n", timeout=30)
    assert sorted(p.name for p in store_dir.parent.iterdir()) == ["kv"]


# ---------------------------------------------------------------------------- sealing


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


def test_verify_flags_a_resealed_record(store_dir: Path):
    stored(store_dir, key(NS_A, 3), forge)
    result = run("verify", store_dir, "--json")
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["corrupt"] == 1


def test_init_gives_an_existing_store_a_private_key(store_dir: Path):
    (store_dir / KEY_FILE_NAME).unlink()  # as a store written before records were sealed
    descriptor = store_dir / "tiered_kv.json"
    descriptor.write_text(json.dumps(json.loads(descriptor.read_text()) | {"record_format_version": 1}))
    refused = run("stats", store_dir)
    assert refused.exit_code == 2 and "storage init" in refused.output
    result = run("init", store_dir, "--json")
    assert result.exit_code == 0, result.output
    fields = json.loads(result.stdout)
    assert fields["sealed_now"] and fields["entries"] == 0 and fields["record_format_version"] == 2
    assert (store_dir / KEY_FILE_NAME).stat().st_mode & 0o777 == 0o600
    assert fields["key_id"] == load_key_file(store_dir / KEY_FILE_NAME).name
    assert run("init", store_dir, "--json").exit_code == 0


def other_store(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    LmdbStore(path, 16 << 20).close()
    return path


def test_import_with_the_wrong_key_refuses_and_writes_nothing(store_dir: Path, tmp_path: Path):
    archive = tmp_path / "a.tkv"
    assert run("export", store_dir, archive).exit_code == 0
    target = other_store(tmp_path, "target")
    before = (target / "data.mdb").read_bytes()
    stranger = other_store(tmp_path, "stranger") / KEY_FILE_NAME
    for extra in ([], ["--key-file", stranger]):
        result = run("import", archive, target, *extra)
        assert result.exit_code == 2 and "nothing imported" in result.output, result.output
        assert "sealed under key" in result.output and len(result.output.strip().splitlines()) == 1
    new = run("import", archive, tmp_path / "new")
    assert new.exit_code == 2 and "--key-file" in new.output and not (tmp_path / "new").exists()
    assert (target / "data.mdb").read_bytes() == before


def test_import_never_overwrites_and_counts_what_was_there_apart_from_skips(store_dir: Path, tmp_path: Path):
    archive = tmp_path / "a.tkv"
    stored(store_dir, key(NS_B, 2), forge)  # exported as stored: its seal no longer verifies
    with LmdbStore(store_dir, readonly=True) as store:
        from tiered_kv.archive import write_archive

        write_archive(archive, store.raw_records(), store.seal_key.key_id)
    target = tmp_path / "target"
    kv = torch.zeros(2, 2, 16, 2, 8).half()
    with LmdbStore(target, 16 << 20) as store:
        for i in (0, 1):  # the target's own, different KV under two of the archive's keys
            store.put(key(NS_A, i), encode_block(key(NS_A, i), None, range(16), kv, "zstd"))
    mine = {i: stored(target, key(NS_A, i)) for i in (0, 1)}
    result = run("import", archive, target, "--key-file", store_dir / KEY_FILE_NAME, "--json")
    assert result.exit_code == 0, result.output
    fields = json.loads(result.stdout)
    assert (fields["records"], fields["imported"]) == (8, 5)
    assert (fields["already_present"], fields["skipped_corrupt"]) == (2, 1)
    assert fields["skipped_by_reason"] == {"mac": 1}  # what failed verification, nothing else
    assert {i: stored(target, key(NS_A, i)) for i in (0, 1)} == mine
    imported = stored(target, key(NS_A, 3))
    assert imported[-SEAL_SIZE:].startswith(load_key_file(target / KEY_FILE_NAME).key_id)
    assert imported[:-SEAL_SIZE] == stored(store_dir, key(NS_A, 3))[:-SEAL_SIZE]
    assert run("verify", target).exit_code == 0
    again = json.loads(run("import", archive, target, "--key-file", store_dir / KEY_FILE_NAME,
                           "--json").output)
    assert (again["imported"], again["already_present"], again["skipped_by_reason"]) == (0, 7, {"mac": 1})


def test_an_export_with_a_record_too_large_to_archive_fails_and_leaves_no_file(
    store_dir: Path, tmp_path: Path, monkeypatch
):
    import tiered_kv.archive

    monkeypatch.setattr(tiered_kv.archive, "MAX_RECORD_BYTES", 64)
    archive = tmp_path / "a.tkv"
    result = run("export", store_dir, archive)
    assert result.exit_code == 2, result.output
    assert "cannot be archived" in result.output and "internal error" not in result.output
    assert not archive.exists() and list(tmp_path.glob("*.tkv*")) == []


def test_an_export_into_a_missing_directory_names_the_archive_not_its_temporary_file(
    store_dir: Path, tmp_path: Path
):
    result = run("export", store_dir, tmp_path / "nowhere" / "a.tkv", "--json")
    assert result.exit_code == 2, result.output
    assert json.loads(result.stdout)["error"] == (
        f"cannot write {tmp_path / 'nowhere' / 'a.tkv'}: No such file or directory"
    )


def test_json_is_never_colored_even_when_the_console_forces_color(store_dir: Path, monkeypatch):
    """FORCE_COLOR makes rich color a pipe too; --json output must still parse."""
    from rich.console import Console

    import tiered_kv.storage_cli as cli

    monkeypatch.setattr(cli, "out", Console(force_terminal=True, color_system="truecolor"))
    for args in (["stats"], ["verify"], ["gc", "--max-size", "1GiB", "--dry-run"]):
        result = run(args[0], store_dir, *args[1:], "--json")
        assert result.exit_code == 0 and "\x1b[" not in result.output, result.output
        json.loads(result.stdout)


def test_clear_with_no_stdin_at_all_is_a_no(store_dir: Path, monkeypatch):
    def lost(*args, **kwargs):
        raise RuntimeError("input(): lost sys.stdin")

    monkeypatch.setattr("typer.confirm", lost)
    result = run("clear", store_dir, "-n", NS_A.hex()[:8], "--json")
    assert result.exit_code == 1 and json.loads(result.stdout)["declined"], result.output


@pytest.mark.parametrize("args", [
    ["gc", "--max-size", "9" * 400 + "PiB"], ["gc", "--older-than", "9" * 400 + "d"],
])
def test_a_size_or_duration_too_large_is_a_usage_error(store_dir: Path, args):
    result = run(args[0], store_dir, *args[1:], "--json")
    assert result.exit_code == 2 and "too" in json.loads(result.stdout)["error"], result.output


def test_an_empty_namespace_is_refused_not_taken_as_every_namespace(store_dir: Path, tmp_path: Path):
    result = run("export", store_dir, tmp_path / "a.tkv", "--namespace", "", "--json")
    assert result.exit_code == 2 and "not a namespace" in result.output
    assert not (tmp_path / "a.tkv").exists()


def test_changes_the_disk_did_not_commit_are_an_error_not_a_report(store_dir: Path, monkeypatch):
    monkeypatch.setattr(LmdbStore, "flush", lambda self, timeout=None: False)
    result = run("gc", store_dir, "--max-size", "1KiB", "--json")
    assert result.exit_code == 2 and "could not all be committed" in json.loads(result.stdout)["error"]
