"""``tiered-kv storage export`` and ``import``: records to and from a portable archive
(``tiered_kv.archive``). Registered on :data:`storage_cli.app`.

An archive's records stay sealed under the exporting store's key. ``import`` verifies them
with that key (the store's own, or ``--key-file``), never overwrites a record the store
has, and re-seals what it adds under the store's key.
"""
from __future__ import annotations

import collections
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from storage.lmdb_store import DESCRIPTOR_NAME
from storage.record import RecordError, decode_record
from storage.seal import KEY_FILE_NAME, SealKey, load_key_file
from tiered_kv.archive import ArchiveError, check_archive, read_archive, read_key_id, write_archive
from tiered_kv.storage_cli import (
    PUT_BATCH, AsJson, Dir, Namespace, _commit, _fail, _open, _open_writer, _print_fields, _progress,
    _resolve_namespace, app, err,
)
from tiered_kv.units import parse_size


def _byte_progress(description: str) -> Progress:
    return Progress(
        TextColumn(description), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
        console=err, transient=True, disable=not err.is_terminal,
    )


@app.command("export")
def export(
    path: Dir,
    archive: Annotated[Path, typer.Argument(help="The archive file to write (must not exist).", metavar="ARCHIVE")],
    namespace: Namespace = None,
    compress: Annotated[bool, typer.Option("--compress", help="zstd-compress the archive.")] = False,
    as_json: AsJson = False,
) -> None:
    """Write records (all, or one namespace) to a portable archive, sealed under the
    store's key: importing them elsewhere needs this store's key file (DIR/seal.key).

    Records that fail verification are left out and counted.
    """
    if archive.exists():
        raise _fail(f"{archive} exists; refusing to overwrite it")
    with _open(path) as store:
        ns = _resolve_namespace(store, namespace) if namespace is not None else None  # "": refused
        total = sum(1 for _ in store.metadata(ns)) if ns is not None else store.stats().entries
        try:
            with _progress("exporting", total) as bar:
                task = bar.add_task("", total=total)
                records = store.verified_records(ns, progress=lambda n: bar.advance(task, n))
                summary = write_archive(
                    archive, ((r.key, r.data) for r in records), store.seal_key.key_id,
                    compress=compress,
                )
        except OSError as e:  # the reason alone: the file it names is the temporary one
            raise _fail(f"cannot write {archive}: {e.strerror or e}") from None
        except ValueError as e:  # a record too large to archive
            raise _fail(f"cannot write {archive}: {e}") from None
    fields = {
        "archive": str(archive),
        "namespace": ns.hex() if ns is not None else None,
        "records": summary.records,
        "record_bytes": summary.record_bytes,
        "archive_bytes": archive.stat().st_size,
        "skipped_corrupt": len(records.unreadable),
        "compressed": compress,
        "key_id": summary.key_id.hex(),
    }
    _print_fields(f"export {path}", fields, as_json)


@app.command("import")
def import_(
    archive: Annotated[Path, typer.Argument(help="An archive written by `export`.", metavar="ARCHIVE")],
    path: Dir,
    size: Annotated[
        str, typer.Option("--size", help="Disk budget if DIR is a new store, e.g. 4GiB.")
    ] = "4GiB",
    key_file: Annotated[
        Path | None,
        typer.Option("--key-file", help="The key file of the store that exported the archive "
                     "(its seal.key), when that is not DIR itself."),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Check a whole archive, then add its valid records to a store (created if missing).

    A truncated or damaged archive, or one sealed under another key than the one given, is
    refused before anything is written. Records are verified with the exporting store's
    key (DIR's own, or --key-file) and re-sealed under DIR's; a record DIR has already is
    never overwritten (counted as already present). A record that fails verification is
    skipped, and counted by reason.
    """
    if not archive.is_file():
        raise _fail(f"{archive}: no such archive")
    try:
        capacity = parse_size(size)
    except ValueError as e:
        raise _fail(str(e)) from None
    new = not (path / DESCRIPTOR_NAME).exists()
    try:  # the key first: an archive no key at hand verifies is refused before it is read
        archive_key = _archive_key(archive, read_key_id(archive), path, new, key_file)
        with _byte_progress("checking archive") as bar:
            task = bar.add_task("", total=archive.stat().st_size)
            summary = check_archive(archive, lambda n: bar.advance(task, n))
    except ArchiveError as e:
        raise _fail(f"{archive}: {e}; nothing imported") from None
    imported = refused = present = 0
    skipped: collections.Counter[str] = collections.Counter()  # failed verification, by reason
    with _open_writer(path, "import", capacity if new else None) as store:
        evictions_before = store.stats().evictions
        try:
            with _progress("importing", summary.records) as bar:
                task = bar.add_task("", total=summary.records)
                batch, batched = [], set()  # a key twice in the archive is one record
                for key, data in read_archive(archive):
                    bar.advance(task)
                    if key in batched or store.contains(key):
                        present += 1  # not a failure: the store keeps its own copy
                        continue
                    try:
                        batch.append((key, decode_record(data, archive_key, key, parallel_mac=True)))
                        batched.add(key)
                    except RecordError as e:
                        skipped[e.reason] += 1
                    if len(batch) >= PUT_BATCH:
                        accepted = store.put_many(batch)
                        imported += sum(accepted)
                        refused += len(accepted) - sum(accepted)
                        batch, batched = [], set()
                accepted = store.put_many(batch)
                imported += sum(accepted)
                refused += len(accepted) - sum(accepted)
        except ArchiveError as e:  # changed since it was checked: keep what was verified
            store.flush()
            raise _fail(f"{archive}: {e}; {imported} records were imported") from None
        _commit(store, f"importing {imported} records")
        evicted = store.stats().evictions - evictions_before
    fields = {
        "archive": str(archive),
        "path": str(path),
        "created": new,
        "records": summary.records,
        "imported": imported,
        "already_present": present,
        "skipped_corrupt": sum(skipped.values()),
        "skipped_by_reason": dict(sorted(skipped.items())),
        "refused_too_large": refused,
        "evicted_for_room": evicted,
    }
    _print_fields(f"import {archive}", fields, as_json)


def _archive_key(
    archive: Path, key_id: bytes, path: Path, new: bool, key_file: Path | None
) -> SealKey:
    """The key that verifies the archive's records: ``--key-file``, else the store's own.
    Refused (nothing written) unless the archive says it was sealed under that key."""
    if key_file is None and new:
        raise _fail(
            f"{archive} is sealed under key {key_id.hex()}; {path} is a new store: give the "
            f"exporting store's key with --key-file (its {KEY_FILE_NAME}); nothing imported"
        )
    try:
        key = load_key_file(key_file if key_file is not None else path / KEY_FILE_NAME)
    except ValueError as e:
        raise _fail(f"{e}; nothing imported") from None
    if key.key_id != key_id:
        given = "the --key-file" if key_file is not None else f"{path}'s own key"
        raise _fail(
            f"{archive} is sealed under key {key_id.hex()}, not {given} ({key.name}); give "
            f"the exporting store's key with --key-file (its {KEY_FILE_NAME}); nothing imported"
        )
    return key


