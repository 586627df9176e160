"""``tiered-kv storage`` on a damaged data file: no command dies, repair salvages, leaks warn."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmdb_testing import leak_past_the_last_page
from storage.codecs import encode_block
from storage.lmdb_store import LmdbStore
from storage.record import SEAL_SIZE
from storage.seal import KEY_FILE_NAME, load_key_file
from storage_cli_testing import HOLD_STORE, NS_A, key, run, small_store


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return small_store(tmp_path)


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
