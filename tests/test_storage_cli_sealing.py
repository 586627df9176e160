"""``tiered-kv storage`` and the store's seal: resealed records, keys, export and import."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from storage.codecs import encode_block
from storage.lmdb_store import LmdbStore
from storage.record import SEAL_SIZE
from storage.seal import KEY_FILE_NAME, load_key_file
from storage_cli_testing import NS_A, NS_B, forge, key, other_store, run, small_store, stored


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return small_store(tmp_path)


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
