"""``tiered-kv storage``: init, stats, ls, verify, errors and exit codes, and interruptions
(a damaged data file: test_storage_cli_damage.py; sealing, export and import:
test_storage_cli_sealing.py)."""
from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from storage.base import StoreError
from storage.lmdb_store import LmdbStore
from storage.seal import KEY_FILE_NAME
from storage_cli_testing import HOLD_STORE, NS_A, NS_B, forge, key, run, small_store, stored


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return small_store(tmp_path)


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
