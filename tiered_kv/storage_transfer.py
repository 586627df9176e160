"""``tiered-kv storage export`` and ``import``: records to and from a portable archive
(``tiered_kv.archive``). Registered on :data:`storage_cli.app`."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from storage.lmdb_store import DESCRIPTOR_NAME
from storage.record import RecordError, decode_record
from tiered_kv.archive import ArchiveError, check_archive, read_archive, write_archive
from tiered_kv.storage_cli import (
    PUT_BATCH, AsJson, Dir, Namespace, _fail, _open, _open_writer, _print_fields, _progress,
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
    archive: Annotated[Path, typer.Argument(help="The archive file to write (must not exist).")],
    namespace: Namespace = None,
    compress: Annotated[bool, typer.Option("--compress", help="zstd-compress the archive.")] = False,
    as_json: AsJson = False,
) -> None:
    """Write records (all, or one namespace) to a portable archive, checksums and all.

    Records that fail verification are left out and counted.
    """
    if archive.exists():
        raise _fail(f"{archive} exists; refusing to overwrite it")
    bad = 0
    with _open(path) as store:
        ns = _resolve_namespace(store, namespace) if namespace else None
        total = sum(1 for _ in store.metadata(ns)) if ns else store.stats().entries

        def verified(bar: Progress, task):
            nonlocal bad
            for key, data in store.raw_records(ns):
                bar.advance(task)
                try:
                    decode_record(data, expected_key=key)
                except RecordError:
                    bad += 1
                    continue
                yield key, data

        try:
            with _progress("exporting", total) as bar:
                summary = write_archive(
                    archive, verified(bar, bar.add_task("", total=total)), compress=compress
                )
        except OSError as e:
            raise _fail(f"cannot write {archive}: {e}") from None
    fields = {
        "archive": str(archive),
        "namespace": ns.hex() if ns else None,
        "records": summary.records,
        "record_bytes": summary.record_bytes,
        "archive_bytes": archive.stat().st_size,
        "skipped_corrupt": bad,
        "compressed": compress,
    }
    _print_fields(f"export {path}", fields, as_json)


@app.command("import")
def import_(
    archive: Annotated[Path, typer.Argument(help="An archive written by `export`.")],
    path: Dir,
    size: Annotated[
        str, typer.Option("--size", help="Disk budget if DIR is a new store, e.g. 4GiB.")
    ] = "4GiB",
    as_json: AsJson = False,
) -> None:
    """Check a whole archive, then add its valid records to a store (created if missing).

    A truncated or damaged archive is refused before anything is written; a record that
    fails verification is skipped and counted.
    """
    if not archive.is_file():
        raise _fail(f"{archive}: no such archive")
    try:
        capacity = parse_size(size)
    except ValueError as e:
        raise _fail(str(e)) from None
    try:
        with _byte_progress("checking archive") as bar:
            task = bar.add_task("", total=archive.stat().st_size)
            summary = check_archive(archive, lambda n: bar.advance(task, n))
    except ArchiveError as e:
        raise _fail(f"{archive}: {e}; nothing imported") from None
    new = not (path / DESCRIPTOR_NAME).exists()
    imported = bad = refused = 0
    with _open_writer(path, "import", capacity if new else None) as store:
        evictions_before = store.stats().evictions
        try:
            with _progress("importing", summary.records) as bar:
                task = bar.add_task("", total=summary.records)
                batch = []
                for key, data in read_archive(archive):
                    bar.advance(task)
                    try:
                        batch.append((key, decode_record(data, expected_key=key)))
                    except RecordError:
                        bad += 1
                    if len(batch) >= PUT_BATCH:
                        accepted = store.put_many(batch)
                        imported += sum(accepted)
                        refused += len(accepted) - sum(accepted)
                        batch = []
                accepted = store.put_many(batch)
                imported += sum(accepted)
                refused += len(accepted) - sum(accepted)
        except ArchiveError as e:  # changed since it was checked: keep what was verified
            store.flush()
            raise _fail(f"{archive}: {e}; {imported} records were imported") from None
        store.flush()
        evicted = store.stats().evictions - evictions_before
    fields = {
        "archive": str(archive),
        "path": str(path),
        "created": new,
        "records": summary.records,
        "imported": imported,
        "skipped_corrupt": bad,
        "refused_too_large": refused,
        "evicted_for_room": evicted,
    }
    _print_fields(f"import {archive}", fields, as_json)


