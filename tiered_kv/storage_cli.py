"""``tiered-kv storage``: administration of a KV cache directory.

Commands:
    init DIR --size SIZE   create a store (or describe an existing one)
    stats DIR              occupancy, counters and LMDB figures
    ls DIR                 namespaces: blocks, bytes, codecs, dtypes, age
    verify DIR             check every record; quarantine the bad ones; exit 1 if any

Read-only commands open the store read-only, so they work while a server writes to it.
Every command takes ``--json``. Errors are one line on stderr and exit code 2.
"""
from __future__ import annotations

import collections
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from storage.base import StoreError
from storage.lmdb_store import LmdbStore, StoreInfo
from tiered_kv.units import format_age, format_size, parse_size

app = typer.Typer(help="Administer a KV cache directory.", no_args_is_help=True)
out = Console()
err = Console(stderr=True, soft_wrap=True)

EXIT_FOUND_CORRUPT = 1
EXIT_ERROR = 2

Dir = Annotated[Path, typer.Argument(help="The KV cache directory.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(EXIT_ERROR)


@contextmanager
def _open(path: Path, *, readonly: bool = True, capacity: int | None = None):
    if readonly and not path.exists():
        raise _fail(f"{path}: no such KV cache directory")
    try:
        store = LmdbStore(path, capacity, readonly=readonly)
    except StoreError as e:
        raise _fail(str(e)) from None
    try:
        yield store
    finally:
        store.close()


def _info_dict(info: StoreInfo) -> dict:
    d = info.descriptor
    return {
        "path": info.path,
        "format": d.format,
        "version": d.version,
        "record_format_version": d.record_format_version,
        "created_ns": d.created_ns,
        "capacity_bytes": d.capacity_bytes,
        "entries": info.entries,
        "bytes_used": info.bytes_used,
        "quarantined": info.quarantined,
        "data_file_bytes": info.data_file_bytes,
        "map_size": info.map_size,
        "page_size": info.page_size,
        "reader_pids": list(info.reader_pids),
    }


def _print_info(info: StoreInfo, as_json: bool) -> None:
    fields = _info_dict(info)
    if as_json:
        out.print_json(json.dumps(fields))
        return
    table = Table(title=f"KV cache {info.path}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    used = fields["bytes_used"] / max(fields["capacity_bytes"], 1)
    rows = [
        ("format", f"{fields['format']} v{fields['version']} (records v{fields['record_format_version']})"),
        ("created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(fields["created_ns"] / 1e9))),
        ("blocks", f"{fields['entries']:,}"),
        ("used", f"{format_size(fields['bytes_used'])} of {format_size(fields['capacity_bytes'])} ({used:.1%})"),
        ("quarantined", f"{fields['quarantined']:,}"),
        ("data file", f"{format_size(fields['data_file_bytes'])} on disk, map {format_size(fields['map_size'])}"),
        ("readers", ", ".join(map(str, fields["reader_pids"])) or "none"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    out.print(table)


@app.command()
def init(
    path: Dir,
    size: Annotated[str, typer.Option("--size", help="Disk budget, e.g. 4GiB, 500MB.")] = "4GiB",
    as_json: AsJson = False,
) -> None:
    """Create a KV cache directory, or describe it if it exists already."""
    try:
        capacity = parse_size(size)
    except ValueError as e:
        raise _fail(str(e)) from None
    existed = (path / "tiered_kv.json").exists()
    with _open(path, readonly=existed, capacity=None if existed else capacity) as store:
        info = store.info()
    if not as_json:
        verb = "exists" if existed else "created"
        out.print(f"KV cache directory {path} {verb}.")
    _print_info(info, as_json)


@app.command()
def stats(path: Dir, as_json: AsJson = False) -> None:
    """Occupancy, counters and LMDB figures of a store."""
    with _open(path) as store:
        _print_info(store.info(), as_json)


def _progress(description: str, total: int) -> Progress:
    return Progress(
        TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=err, transient=True,
    )


@app.command("ls")
def list_namespaces(path: Dir, as_json: AsJson = False) -> None:
    """Namespaces in a store: blocks, bytes, codecs, dtypes and age."""
    rows: dict[str, dict] = collections.defaultdict(
        lambda: {"blocks": 0, "bytes": 0, "codecs": set(), "dtypes": set(),
                 "oldest_ns": None, "newest_ns": None}
    )
    with _open(path) as store:
        total = store.stats().entries
        with _progress("reading records", total) as bar:
            task = bar.add_task("", total=total)
            for key in store.keys():
                record = store.get(key)
                bar.advance(task)
                if record is None:
                    continue
                row = rows[key.namespace.hex()]
                row["blocks"] += 1
                row["bytes"] += record.nbytes
                row["codecs"].add(record.codec)
                row["dtypes"].add(str(record.dtype).removeprefix("torch."))
                row["oldest_ns"] = min(row["oldest_ns"] or record.created_ns, record.created_ns)
                row["newest_ns"] = max(row["newest_ns"] or record.created_ns, record.created_ns)
    result = [
        {"namespace": ns, **r, "codecs": sorted(r["codecs"]), "dtypes": sorted(r["dtypes"])}
        for ns, r in sorted(rows.items())
    ]
    if as_json:
        out.print_json(json.dumps(result))
        return
    table = Table(title=f"Namespaces in {path}")
    for column in ("namespace", "blocks", "bytes", "codec", "dtype", "newest", "oldest"):
        table.add_column(column, justify="right" if column in ("blocks", "bytes") else "left")
    now = time.time_ns()
    for r in result:
        table.add_row(
            r["namespace"][:16], f"{r['blocks']:,}", format_size(r["bytes"]),
            ", ".join(r["codecs"]), ", ".join(r["dtypes"]),
            format_age((now - r["newest_ns"]) / 1e9), format_age((now - r["oldest_ns"]) / 1e9),
        )
    out.print(table)


@app.command()
def verify(path: Dir, as_json: AsJson = False) -> None:
    """Check every record; quarantine the bad ones. Exit 1 if any record was bad.

    When a server holds the store, bad records are reported but left for the server to
    quarantine on its next read.
    """
    with _open(path):
        pass  # a clean error, and nothing created, if this is not a store
    try:
        store = LmdbStore(path, None)
    except StoreError:
        store = None
    readonly = store is None
    with (_open(path) if readonly else _closing(store)) as opened:
        total = opened.stats().entries
        with _progress("verifying", total) as bar:
            task = bar.add_task("", total=total)
            result = opened.verify(progress=lambda n: bar.advance(task, n))
    fields = result._asdict() | {"readonly": readonly}
    if as_json:
        out.print_json(json.dumps(fields))
    else:
        table = Table(title=f"verify {path}", show_header=False)
        for name, value in fields.items():
            table.add_row(name, str(value))
        out.print(table)
        if readonly and result.corrupt:
            out.print("A server holds this store: the bad records were left for it to quarantine.")
    if result.corrupt:
        raise typer.Exit(EXIT_FOUND_CORRUPT)


@contextmanager
def _closing(store: LmdbStore):
    try:
        yield store
    finally:
        store.close()
