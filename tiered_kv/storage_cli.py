"""``tiered-kv storage``: administration of a KV cache directory.

Commands:
    init DIR --size SIZE   create a store (or describe an existing one; --size resizes it)
    stats DIR              occupancy, counters and LMDB figures
    ls DIR                 namespaces: blocks, bytes, codecs, dtypes, age
    verify DIR             check every record; quarantine the bad ones; exit 1 if any;
                           count leaked pages
    tree DIR               the stored prefix trees, optionally with each block's text
                           (alias: inspect; in ``storage_tree``)
    gc DIR                 evict blocks unused for a while, or down to a size (alias: evict;
                           in ``storage_maintenance``, with compact, clear and repair)
    compact DIR            rewrite the data file without its free pages
    export DIR ARCHIVE     write records (all, or one namespace) to a portable archive
                           (created 0600; in ``storage_transfer``, with import)
    import ARCHIVE DIR     check an archive, then add its valid records to a store
    clear DIR --namespace  delete every record of one namespace
    repair DIR [--out DST] salvage the readable records of a damaged store into a fresh one

Read-only commands (stats, ls, verify, tree, export, ``gc --dry-run``, ``compact
--output``) open the store read-only, so they work while a server writes to it. Commands
that change a store (gc, clear, import, compact in place, repair) need the writer lock, so
they refuse to run while a server holds the directory. Every command takes ``--json``.
Errors, usage errors included, are one line and exit code 2 (``storage_errors``; with
``--json``, ``{"error": ...}`` on stdout); Ctrl-C is ``interrupted`` and exit code 130.
Before LMDB maps ``data.mdb``, every
command checks the pages LMDB could reach (only the meta pages if a server keeps
committing meanwhile): a damaged file is an error naming ``repair``, never a crash.
"""
from __future__ import annotations

import collections
import json
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from storage.base import StoreError
from storage.lmdb_layout import has_data
from storage.lmdb_pages import Leak
from storage.lmdb_store import DamagedStore, LmdbStore, StoreInfo
from storage.seal import KEY_FILE_NAME
from tiered_kv.storage_errors import CommandError, StorageGroup
from tiered_kv.storage_errors import fail as _fail
from tiered_kv.units import format_age, format_size, parse_size

app = typer.Typer(help="Administer a KV cache directory.", no_args_is_help=True, cls=StorageGroup,
                  rich_markup_mode="markdown")  # as the top-level app: see tiered_kv/cli.py
out = Console()
err = Console(stderr=True, soft_wrap=True)

EXIT_FOUND_CORRUPT = 1

Dir = Annotated[Path, typer.Argument(help="The KV cache directory.", metavar="DIR")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _fail_store(error: StoreError, path: Path) -> CommandError:
    if isinstance(error, DamagedStore):
        return _fail(f"{error}; `tiered-kv storage repair {path}` salvages the readable records")
    return _fail(str(error))


@contextmanager
def _open(
    path: Path, *, readonly: bool = True, capacity: int | None = None, full_check: bool = True
):
    """The store, its data file checked page by page first (unless ``full_check=False``:
    checked just before); errors as one line."""
    if readonly and not path.exists():
        raise _fail(f"{path}: no such KV cache directory")
    try:
        store = LmdbStore(path, capacity, readonly=readonly, full_check=full_check)
    except StoreError as e:
        raise _fail_store(e, path) from None
    with _closing(store, path):
        yield store


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


def print_json(document: object) -> None:
    """One JSON document on stdout, never colored (rich colors it under FORCE_COLOR even
    into a pipe, and a parser then fails)."""
    typer.echo(json.dumps(document, indent=2))


def _print_info(info: StoreInfo, as_json: bool, extra: dict | None = None) -> None:
    fields = _info_dict(info)
    if as_json:
        print_json(fields | (extra or {}))
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


DEFAULT_SIZE = "4GiB"


@app.command()
def init(
    path: Dir,
    size: Annotated[
        str | None,
        typer.Option("--size", help=f"Disk budget, e.g. 4GiB, 500MB (default {DEFAULT_SIZE}). On an "
                     "existing store: its new budget; a smaller one evicts in the server's "
                     "order: the highest priority value first, chains from their end, least "
                     "recently used first."),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Create a KV cache directory, or describe it if it exists already (and resize it to
    --size if given; that needs the writer lock). A store whose creation was cut short (a
    full disk) is completed.

    The store's records are sealed with the secret in DIR/seal.key, created 0600 with the
    store. A store written before records were sealed gets its key here and drops its old
    records (they cannot be verified).
    """
    try:
        capacity = parse_size(size) if size is not None else None
    except ValueError as e:
        raise _fail(str(e)) from None
    existed = (path / "tiered_kv.json").exists()
    sealed = (path / KEY_FILE_NAME).exists()
    new_capacity = None if existed else capacity or parse_size(DEFAULT_SIZE)
    # A writer completes a store whose creation was cut short (no data file yet).
    readonly = existed and sealed and has_data(path)
    with _open(path, readonly=readonly, capacity=new_capacity) as store:
        info = store.info()
        key_id = store.seal_key.name
    before = info.descriptor.capacity_bytes
    resized = existed and capacity is not None and capacity != before
    evicted = 0
    if resized:
        with _open_writer(
            path, "resizing", capacity, instead="restart it with --kv-disk-size, which sets the budget"
        ) as store:
            evicted = store.stats().evictions
            _commit(store, "the new budget's evictions")
            info = store.info()
    if not as_json:
        if resized:
            out.print(f"KV cache directory {path} resized from {format_size(before)} to "
                      f"{format_size(capacity)}; {evicted:,} blocks evicted.")
        else:
            out.print(f"KV cache directory {path} {'exists' if existed else 'created'}.")
        out.print(f"Its records are sealed with {path / KEY_FILE_NAME} (key {key_id})"
                  + ("; the records of the unsealed format were dropped." if existed and not sealed else "."))
    extra = {"created": not existed, "resized_from": before if resized else None,
             "evicted_blocks": evicted, "sealed_now": existed and not sealed,
             "key_file": str(path / KEY_FILE_NAME), "key_id": key_id}
    _print_info(info, as_json, extra)


@app.command()
def stats(path: Dir, as_json: AsJson = False) -> None:
    """Occupancy, counters and LMDB figures of a store."""
    with _open(path) as store:
        _print_info(store.info(), as_json)


def _progress(description: str, total: int) -> Progress:
    return Progress(
        TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=err, transient=True, disable=not err.is_terminal,
    )


@app.command("ls")
def list_namespaces(path: Dir, as_json: AsJson = False) -> None:
    """Namespaces in a store: blocks, bytes, codecs, dtypes and age (with --json, also the
    blocks at each eviction priority). Records that fail verification are not listed but
    counted (``unreadable``, and a warning on stderr); `verify` quarantines them."""
    rows: dict[str, dict] = collections.defaultdict(
        lambda: {"blocks": 0, "bytes": 0, "codecs": set(), "dtypes": set(),
                 "oldest_ns": None, "newest_ns": None, "unreadable": 0}
    )
    with _open(path) as store:
        total = store.stats().entries
        with _progress("reading records", total) as bar:
            task = bar.add_task("", total=total)
            records = store.verified_records(progress=lambda n: bar.advance(task, n))
            for key, record, _ in records:
                row = rows[key.namespace.hex()]
                row["blocks"] += 1
                row["bytes"] += record.nbytes
                row["codecs"].add(record.codec)
                row["dtypes"].add(str(record.dtype).removeprefix("torch."))
                row["oldest_ns"] = min(row["oldest_ns"] or record.created_ns, record.created_ns)
                row["newest_ns"] = max(row["newest_ns"] or record.created_ns, record.created_ns)
        by_priority: dict[str, collections.Counter[int]] = collections.defaultdict(
            collections.Counter
        )
        failed = set(records.unreadable)
        for key in failed:
            rows[key.namespace.hex()]["unreadable"] += 1
        for meta in store.metadata():  # no record read: the meta db alone
            if meta.key not in failed:  # the listed blocks' priorities only
                by_priority[meta.key.namespace.hex()][meta.priority] += 1
    for ns, row in rows.items():
        row["priorities"] = {str(p): n for p, n in sorted(by_priority[ns].items())}
    result = [
        {"namespace": ns, **r, "codecs": sorted(r["codecs"]), "dtypes": sorted(r["dtypes"])}
        for ns, r in sorted(rows.items())
    ]
    unreadable = sum(r["unreadable"] for r in result)
    if unreadable:  # exit 0 all the same, as tree and export: finding them is verify's job
        what = "record fails" if unreadable == 1 else "records fail"
        typer.echo(f"warning: {path}: {unreadable:,} {what} verification and not listed; "
                   f"`tiered-kv storage verify {path}` quarantines them", err=True)
    if as_json:
        print_json(result)
        return
    table = Table(title=f"Namespaces in {path}")
    for column in ("namespace", "blocks", "bytes", "codec", "dtype", "newest", "oldest"):
        table.add_column(column, justify="right" if column in ("blocks", "bytes") else "left")
    now = time.time_ns()
    for r in result:
        ages = [format_age((now - r[f"{end}_ns"]) / 1e9) if r["blocks"] else "-"  # all unreadable
                for end in ("newest", "oldest")]
        table.add_row(
            r["namespace"][:16], f"{r['blocks']:,}", format_size(r["bytes"]),
            ", ".join(r["codecs"]), ", ".join(r["dtypes"]), *ages,
        )
    out.print(table)


@app.command()
def verify(path: Dir, as_json: AsJson = False) -> None:
    """Check every record (its seal under the store's key, its fields, its key); quarantine
    the bad ones. Exit 1 if any record was bad.

    When a server holds the store, bad records are reported but left for the server to
    quarantine on its next read (and where the store cannot be written, left as they are).
    Leaked pages the file check found (pages nothing uses or frees) are reported too, as a
    warning: they waste room but harm no record.
    """
    # A clean error, and nothing created, if this is not a store or is damaged.
    with _open(path) as checked:
        leaked = checked.leaked
    try:
        store = LmdbStore(path, None)  # checked just above
    except StoreError as e:
        store, unwritable = None, e
    readonly = store is None
    with (_open(path, full_check=False) if readonly else _closing(store, path)) as opened:
        total = opened.stats().entries
        with _progress("verifying", total) as bar:
            task = bar.add_task("", total=total)
            result = opened.verify(progress=lambda n: bar.advance(task, n))
    fields = result._asdict() | {"readonly": readonly}
    if as_json:
        print_json(fields | {  # None: not counted (a server committed throughout the check)
            "leaked_pages": leaked.pages if leaked is not None else None,
            "first_leaked_pages": list(leaked.first) if leaked is not None else [],
        })
    else:
        table = Table(title=f"verify {path}", show_header=False)
        for name, value in (fields | {"leaked_pages": _leaked_text(leaked)}).items():
            table.add_row(name, str(value))
        out.print(table)
        if readonly and result.corrupt:
            holder = _holder(unwritable)
            out.print(
                f"A server holds this store ({holder}): the bad records were left for it to "
                "quarantine." if holder else
                f"The store cannot be written ({unwritable}): the bad records were left as they are."
            )
    if result.corrupt:
        raise typer.Exit(EXIT_FOUND_CORRUPT)


def _leaked_text(leaked: Leak | None) -> str:
    if leaked is None:
        return "not counted (a server kept committing)"
    return f"{leaked.pages:,} (pages {leaked.listed()})" if leaked.pages else "0"


def _commit(store: LmdbStore, what: str) -> None:
    """Wait for the store's writer; a clean error if what it was given could not all be
    committed (a full or failing disk), rather than a report of changes that did not happen.
    Part of it may have been: the store's writer commits in batches."""
    if not store.flush():
        raise _fail(
            f"{store.path}: {what} could not all be committed (a full or failing disk?); "
            f"`tiered-kv storage stats {store.path}` shows what the store holds"
        )


@contextmanager
def _closing(store: LmdbStore, path: Path):
    try:
        yield store
    except StoreError as e:  # the file turned out damaged while reading it
        raise _fail_store(e, path) from None
    finally:
        store.close()


Namespace = Annotated[
    str | None,
    typer.Option("--namespace", "-n", help="A namespace, as hex (a unique prefix will do)."),
]
PUT_BATCH = 256  # records queued per put_many: one writer transaction each


@contextmanager
def _open_writer(path: Path, purpose: str, capacity: int | None = None, *, instead: str = ""):
    """The store opened for writing, or a clean error saying who holds the writer lock."""
    if capacity is None:
        with _open(path):
            pass  # a clean error, and nothing created, if this is not a store or is damaged
    try:
        store = LmdbStore(path, capacity, full_check=capacity is not None)
    except StoreError as e:
        raise _writer_error(e, path, purpose, instead) from None
    with _closing(store, path):
        yield store


def _holder(error: StoreError) -> str | None:
    """``by pid N`` if ``error`` says that another process holds the writer lock."""
    holder = re.search(r"already open for writing \((by pid \S+)\)", str(error))
    return holder.group(1) if holder else None


def _writer_error(error: StoreError, path: Path, purpose: str, instead: str = "") -> CommandError:
    holder = _holder(error)
    if holder:
        return _fail(
            f"{path} is held by a running server ({holder}); "
            f"{purpose} needs the writer lock: stop the server first"
            + (f", or {instead}" if instead else "")
        )
    return _fail_store(error, path)


def _resolve_namespace(store: LmdbStore, text: str) -> bytes:
    """The one namespace of ``store`` whose hex starts with ``text``."""
    wanted = text.strip().lower()
    if not wanted or any(c not in "0123456789abcdef" for c in wanted):
        raise _fail(f"not a namespace: {text!r} (expected hex, as `ls` prints it)")
    matches = [ns for ns in store.namespaces() if ns.hex().startswith(wanted)]
    if not matches:
        raise _fail(f"{store.path}: no namespace starting with {wanted}")
    if len(matches) > 1:
        raise _fail(f"{store.path}: {len(matches)} namespaces start with {wanted}; give more digits")
    return matches[0]


def _print_fields(title: str, fields: dict, as_json: bool) -> None:
    if as_json:
        print_json(fields)
        return
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in fields.items():
        if isinstance(value, int) and not isinstance(value, bool) and "bytes" in name and value >= 1024:
            value = f"{format_size(value)} ({value:,} B)"
        table.add_row(name.replace("_", " "), str(value))
    out.print(table)


# ---------------------------------------------------------------------------- gc


from tiered_kv import storage_maintenance, storage_transfer, storage_tree  # noqa: E402,F401
