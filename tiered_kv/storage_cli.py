"""``tiered-kv storage``: administration of a KV cache directory.

Commands:
    init DIR --size SIZE   create a store (or describe an existing one)
    stats DIR              occupancy, counters and LMDB figures
    ls DIR                 namespaces: blocks, bytes, codecs, dtypes, age
    verify DIR             check every record; quarantine the bad ones; exit 1 if any
    tree DIR               the stored prefix trees, optionally with each block's text
                           (alias: inspect)
    gc DIR                 evict blocks unused for a while, or down to a size (alias: evict)
    compact DIR            rewrite the data file without its free pages
    export DIR ARCHIVE     write records (all, or one namespace) to a portable archive
                           (created 0600)
    import ARCHIVE DIR     check an archive, then add its valid records to a store
    clear DIR --namespace  delete every record of one namespace
    repair DIR [--out DST] salvage the readable records of a damaged store into a fresh one

Read-only commands (stats, ls, verify, tree, export, ``gc --dry-run``, ``compact
--output``) open the store read-only, so they work while a server writes to it. Commands
that change a store (gc, clear, import, compact in place, repair) need the writer lock, so
they refuse to run while a server holds the directory. Every command takes ``--json``.
Errors are one line on stderr and exit code 2. Before LMDB maps ``data.mdb``, every
command checks the pages LMDB could reach (only the meta pages if a server keeps
committing meanwhile): a damaged file is an error naming ``repair``, never a crash.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn,
)
from rich.table import Table
from rich.tree import Tree

from storage.base import BlockKey, StoreError
from storage.lmdb_store import DESCRIPTOR_NAME, DamagedStore, LmdbStore, StoreInfo
from storage.record import RecordError, decode_record
from tiered_kv.archive import ArchiveError, check_archive, read_archive, write_archive
from tiered_kv.units import format_age, format_size, parse_duration, parse_size

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


def _fail_store(error: StoreError, path: Path) -> typer.Exit:
    if isinstance(error, DamagedStore):
        return _fail(f"{error}; `tiered-kv storage repair {path}` salvages the readable records")
    return _fail(str(error))


@contextmanager
def _open(path: Path, *, readonly: bool = True, capacity: int | None = None):
    """The store, its data file checked page by page first; errors as one line."""
    if readonly and not path.exists():
        raise _fail(f"{path}: no such KV cache directory")
    try:
        store = LmdbStore(path, capacity, readonly=readonly, full_check=True)
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
        console=err, transient=True, disable=not err.is_terminal,
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
        pass  # a clean error, and nothing created, if this is not a store or is damaged
    try:
        store = LmdbStore(path, None)  # checked just above
    except StoreError:
        store = None
    readonly = store is None
    with (_open(path) if readonly else _closing(store, path)) as opened:
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


def _writer_error(error: StoreError, path: Path, purpose: str, instead: str = "") -> typer.Exit:
    holder = re.search(r"already open for writing \((by pid \S+)\)", str(error))
    if holder:
        return _fail(
            f"{path} is held by a running server ({holder.group(1)}); "
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
        out.print_json(json.dumps(fields))
        return
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in fields.items():
        if isinstance(value, int) and not isinstance(value, bool) and "bytes" in name and value >= 1024:
            value = f"{format_size(value)} ({value:,} B)"
        table.add_row(name.replace("_", " "), str(value))
    out.print(table)


# ---------------------------------------------------------------------------- tree


@dataclasses.dataclass
class _Node:
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    codec: str
    dtype: str
    nbytes: int
    created_ns: int
    children: list[_Node] = dataclasses.field(default_factory=list)


def _load_tokenizer(spec: str):
    from engine.tokenizer import Tokenizer

    try:
        if spec == "tiny":
            from engine.models.tiny import tiny_model_path

            return Tokenizer.from_folder(tiny_model_path())
        return Tokenizer.from_folder(spec)
    except (OSError, ValueError) as e:
        raise _fail(f"cannot load a tokenizer from {spec}: {e}") from None


def _read_tree(store: LmdbStore, namespace: bytes) -> tuple[list[_Node], int, int]:
    """The roots of the namespace's prefix tree, how many blocks it has, how many were bad."""
    nodes: dict[bytes, _Node] = {}
    bad = 0
    total = sum(1 for _ in store.metadata(namespace))
    with _progress(f"reading {namespace.hex()[:16]}", total) as bar:
        task = bar.add_task("", total=total)
        for key, data in store.raw_records(namespace):
            bar.advance(task)
            try:
                record = decode_record(data, expected_key=key)
            except RecordError:
                bad += 1
                continue
            nodes[key.block_hash] = _Node(
                key.block_hash, record.parent_hash, record.token_ids, record.codec,
                str(record.dtype).removeprefix("torch."), len(data), record.created_ns,
            )
    roots = []
    for node in nodes.values():
        parent = nodes.get(node.parent_hash) if node.parent_hash is not None else None
        (parent.children if parent is not None else roots).append(node)
    for node in nodes.values():
        node.children.sort(key=_oldest_first)
    roots.sort(key=_oldest_first)
    return roots, len(nodes), bad


def _oldest_first(node: _Node) -> tuple[int, bytes]:
    return node.created_ns, node.block_hash


def _walk(roots: list[_Node], depth: int | None):
    """Depth-first, without recursion (chains run thousands of blocks deep):
    ``(node, position, parent-or-None, hidden)`` where ``hidden`` counts the blocks
    below ``node`` that ``depth`` cuts off."""
    stack = [(root, 0, None) for root in reversed(roots)]
    while stack:
        node, position, parent = stack.pop()
        if depth is not None and position + 1 >= depth:
            hidden, below = 0, list(node.children)
            while below:
                child = below.pop()
                hidden += 1
                below.extend(child.children)
            yield node, position, parent, hidden
            continue
        yield node, position, parent, 0
        stack.extend((child, position + 1, node) for child in reversed(node.children))


def _block_text(tokenizer, node: _Node) -> str | None:
    return None if tokenizer is None else tokenizer.decode(node.token_ids, skip_special_tokens=False)


def _label(node: _Node, position: int, text: str | None, orphan: bool) -> str:
    label = (
        f"[dim]#{position}[/dim] [bold]{node.block_hash.hex()[:12]}[/bold]  "
        f"{len(node.token_ids)} tok  {node.codec}  {node.dtype}  {format_size(node.nbytes)}"
    )
    if orphan:
        label += "  [yellow](parent not stored)[/yellow]"
    if text is not None:
        shown = text if len(text) <= 60 else text[:57] + "..."
        label += f"  [green]{escape(repr(shown))}[/green]"
    return label


@app.command("tree")
def tree(
    path: Dir,
    namespace: Namespace = None,
    tokenizer: Annotated[
        str | None,
        typer.Option("--tokenizer", help="Show each block's text: a model folder, or `tiny`."),
    ] = None,
    depth: Annotated[
        int | None, typer.Option("--depth", min=1, help="Show at most this many blocks deep.")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """The stored prefix trees: root blocks, then the blocks that continue them.

    A chain without branches is listed flat under its first block; where blocks branch,
    each branch opens a level. ``#N`` is a block's position in its sequence.
    """
    tok = _load_tokenizer(tokenizer) if tokenizer is not None else None
    result = []
    with _open(path) as store:
        spaces = [_resolve_namespace(store, namespace)] if namespace else store.namespaces()
        for ns in spaces:
            roots, blocks, bad = _read_tree(store, ns)
            result.append((ns, roots, blocks, bad))
    if as_json:
        rows = []
        for ns, roots, blocks, bad in result:
            listed = []
            for node, position, parent, hidden in _walk(roots, depth):
                row = {
                    "hash": node.block_hash.hex(),
                    "parent": node.parent_hash.hex() if node.parent_hash else None,
                    "parent_stored": parent is not None or node.parent_hash is None,
                    "position": position,
                    "tokens": len(node.token_ids),
                    "token_ids": list(node.token_ids),
                    "codec": node.codec,
                    "dtype": node.dtype,
                    "bytes": node.nbytes,
                    "created_ns": node.created_ns,
                    "children": len(node.children),
                    "hidden_below": hidden,
                }
                if tok is not None:
                    row["text"] = _block_text(tok, node)
                listed.append(row)
            rows.append({"namespace": ns.hex(), "blocks": blocks, "roots": len(roots),
                         "unreadable": bad, "nodes": listed})
        typer.echo(json.dumps(rows))  # compact: a tree can list millions of blocks
        return
    if not result:
        out.print(f"{path}: no records.")
    for ns, roots, blocks, bad in result:
        top = Tree(
            f"namespace [bold]{ns.hex()[:16]}[/bold]: {blocks:,} blocks, {len(roots):,} roots"
            + (f", [red]{bad} unreadable[/red]" if bad else "")
        )
        item_of: dict[bytes, Tree] = {}  # a block's own entry: its branches go here
        run_of: dict[bytes, Tree] = {}  # the entry of the block that starts its chain
        for node, position, parent, hidden in _walk(roots, depth):
            orphan = parent is None and node.parent_hash is not None
            if parent is None:
                under = top
            elif len(parent.children) == 1:
                under = run_of[parent.block_hash]  # a chain goes on under its first block
            else:
                under = item_of[parent.block_hash]  # a branch point: each branch starts a chain
            item = under.add(_label(node, position, _block_text(tok, node), orphan))
            if hidden:
                item.add(f"[dim]... {hidden:,} more blocks below --depth[/dim]")
            item_of[node.block_hash] = item
            starts_run = parent is None or len(parent.children) > 1
            run_of[node.block_hash] = item if starts_run else run_of[parent.block_hash]
        out.print(top)


app.command("inspect", help="Alias of `tree`.")(tree)


# ---------------------------------------------------------------------------- gc


def _delete(store: LmdbStore, keys: list[BlockKey], description: str) -> int:
    removed = 0
    with _progress(description, len(keys)) as bar:
        task = bar.add_task("", total=len(keys))
        for start in range(0, len(keys), PUT_BATCH):
            chunk = keys[start : start + PUT_BATCH]
            removed += store.delete_many(chunk)
            bar.advance(task, len(chunk))
    store.flush()
    return removed


@app.command("gc")
def gc(
    path: Dir,
    older_than: Annotated[
        str | None,
        typer.Option("--older-than", help="Evict blocks not used for this long, e.g. 7d, 12h."),
    ] = None,
    max_size: Annotated[
        str | None,
        typer.Option("--max-size", help="Then evict least recently used blocks until under this."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only report what would be evicted (read-only).")
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Evict blocks by age (last access, else creation) and/or down to a size, LRU first."""
    if older_than is None and max_size is None:
        raise _fail("say what to evict: --older-than DURATION, --max-size SIZE, or both")
    try:
        max_age = parse_duration(older_than) if older_than is not None else None
        limit = parse_size(max_size) if max_size is not None else None
    except ValueError as e:
        raise _fail(str(e)) from None
    opener = _open(path) if dry_run else _open_writer(
        path, "gc", instead="let the server evict: it keeps the disk tier within --kv-disk-size, "
        "and POST /admin/evict on the server drops a namespace's blocks",
    )
    with opener as store:
        # Least recently used first; an unknown access time (0) falls back to creation.
        entries = sorted(store.metadata(), key=lambda m: (m.last_access_ns or m.created_ns, m.key))
        total = sum(m.nbytes for m in entries)
        cutoff = time.time_ns() - int(max_age * 1e9) if max_age is not None else None
        victims = [m for m in entries if cutoff is not None and (m.last_access_ns or m.created_ns) < cutoff]
        remaining = total - sum(m.nbytes for m in victims)
        if limit is not None:
            chosen = {m.key for m in victims}
            for m in entries:
                if remaining <= limit:
                    break
                if m.key not in chosen:
                    victims.append(m)
                    remaining -= m.nbytes
        freed = sum(m.nbytes for m in victims)
        if not dry_run and victims:
            _delete(store, [m.key for m in victims], "evicting")
    fields = {
        "dry_run": dry_run,
        "evicted_blocks" if not dry_run else "would_evict_blocks": len(victims),
        "evicted_bytes" if not dry_run else "would_evict_bytes": freed,
        "remaining_blocks": len(entries) - len(victims),
        "remaining_bytes": total - freed,
    }
    _print_fields(f"gc {path}", fields, as_json)


app.command("evict", help="Alias of `gc`.")(gc)


# ---------------------------------------------------------------------------- compact


def _file_size(directory: Path) -> int:
    try:
        return (directory / "data.mdb").stat().st_size
    except OSError:
        return 0


@app.command("compact")
def compact(
    path: Dir,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write the compacted copy here (a new directory) "
                     "instead of replacing the store's data file; works while a server writes."),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Rewrite the data file without free pages (LMDB's compacting copy).

    In place, the store must be idle: no server, no other process reading it.
    """
    before = _file_size(path)
    if output is not None:
        if output.exists():
            raise _fail(f"{output} exists; --output must name a new directory")
        with _open(path) as store, err.status("compacting"):
            try:
                store.copy_compacted(output)
            except StoreError as e:
                raise _fail(str(e)) from None
        target = output
    else:
        with _open_writer(
            path, "compacting in place", instead="write a compacted copy with --output DIR2"
        ) as store, err.status("compacting"):
            try:
                store.compact_and_close()
            except StoreError as e:
                raise _fail(str(e)) from None
        target = path
    after = _file_size(target)
    fields = {
        "path": str(path),
        "output": str(target),
        "bytes_before": before,
        "bytes_after": after,
        "saved_bytes": before - after,
    }
    _print_fields(f"compact {path}", fields, as_json)


# ---------------------------------------------------------------------------- export / import


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


# ---------------------------------------------------------------------------- clear


@app.command("clear")
def clear(
    path: Dir,
    namespace: Annotated[
        str, typer.Option("--namespace", "-n", help="The namespace to delete, as hex (a unique prefix will do).")
    ],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    as_json: AsJson = False,
) -> None:
    """Delete every record of one namespace."""
    with _open(path) as store:
        ns = _resolve_namespace(store, namespace)
    with _open_writer(
        path, "clear", instead=f'POST /admin/clear with {{"namespace": "{ns.hex()}"}} on the server'
    ) as store:
        victims = list(store.metadata(ns))
        nbytes = sum(m.nbytes for m in victims)
        if not yes and not typer.confirm(
            f"Delete {len(victims):,} blocks ({format_size(nbytes)}) of namespace {ns.hex()[:16]}?",
            err=True,
        ):
            err.print("Nothing deleted.")
            raise typer.Exit(EXIT_FOUND_CORRUPT)
        removed = _delete(store, [m.key for m in victims], "deleting")
    fields = {"namespace": ns.hex(), "deleted_blocks": removed, "deleted_bytes": nbytes}
    _print_fields(f"clear {path}", fields, as_json)


# ---------------------------------------------------------------------------- repair


@app.command("repair")
def repair_(
    path: Dir,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Write the salvaged store here (a new directory) and "
                     "leave DIR as it is. Without it DIR is replaced, and the damaged store kept "
                     "as DIR.damaged-TIME."),
    ] = None,
    size: Annotated[
        str | None, typer.Option("--size", help="Budget of the new store (default: DIR's).")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Salvage the readable records of a damaged store into a fresh one.

    data.mdb is read page by page, never mapped, so no damage can crash it; every record
    is checked against its key and checksum, and what cannot be read or fails is skipped
    and counted. Needs the writer lock: stop the server first.
    """
    if not path.is_dir():
        raise _fail(f"{path}: no such KV cache directory")
    try:
        capacity = parse_size(size) if size is not None else None
    except ValueError as e:
        raise _fail(str(e)) from None
    try:
        with _progress("salvaging", 0) as bar:
            task = bar.add_task("", total=None)
            result = LmdbStore.repair(
                path, out_dir, capacity_bytes=capacity,
                progress=lambda n: bar.advance(task, n),
                expected=lambda n: bar.update(task, total=n),
            )
    except StoreError as e:
        raise _writer_error(e, path, "repair") from None
    fields = {
        "path": str(path),
        "output": str(result.output),
        "moved_aside": str(result.moved_aside) if result.moved_aside else None,
        "salvaged": result.salvaged,
        "skipped": result.skipped,
        "evicted_for_room": result.evicted,
        "problems": len(result.problems),
    }
    _print_fields(f"repair {path}", fields, as_json)
    if result.problems and not as_json:
        err.print(f"first problem: {result.problems[0]}", highlight=False)
