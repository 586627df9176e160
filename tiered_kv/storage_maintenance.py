"""``tiered-kv storage`` maintenance: gc (alias evict), compact, clear and repair. Registered on
:data:`storage_cli.app`; see its docstring for the commands and how errors are reported."""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from storage.base import BlockKey, StoreError
from storage.lmdb_eviction import ChainLru
from storage.lmdb_store import LmdbStore
from tiered_kv.storage_cli import (
    EXIT_FOUND_CORRUPT,
    PUT_BATCH,
    AsJson,
    Dir,
    _commit,
    _fail,
    _open,
    _open_writer,
    _print_fields,
    _progress,
    _resolve_namespace,
    _writer_error,
    app,
    err,
)
from tiered_kv.units import format_size, parse_duration, parse_size


def _delete(store: LmdbStore, keys: list[BlockKey], description: str) -> int:
    removed = 0
    with _progress(description, len(keys)) as bar:
        task = bar.add_task("", total=len(keys))
        for start in range(0, len(keys), PUT_BATCH):
            chunk = keys[start : start + PUT_BATCH]
            removed += store.delete_many(chunk)
            bar.advance(task, len(chunk))
    _commit(store, f"deleting {removed} blocks")
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
        typer.Option("--max-size", help="Then evict blocks until under this, in the server's "
                     "order: the highest priority value first, chains from their end, least "
                     "recently used first."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only report what would be evicted (read-only).")
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Evict blocks by age (last access, else creation) and/or down to a size, in the
    order the server evicts: the highest priority value first; within one, the blocks that
    end their chain before those with a child stored, LRU first within each."""
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
        if limit is not None and remaining > limit:
            # The store's eviction order: the highest priority value first, chain ends first
            # within one, least recently used first within each.
            by_key = {m.key.to_bytes(): m for m in entries}
            order = ChainLru.build(
                list(by_key), [m.nbytes for m in entries], [m.priority for m in entries],
                [m.parent_hash for m in entries],
            )
            for m in victims:
                order.pop(m.key.to_bytes())
            while remaining > limit:
                kb = order.first()
                order.pop(kb)
                victims.append(by_key[kb])
                remaining -= by_key[kb].nbytes
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
        if not yes and not _confirmed(
            f"Delete {len(victims):,} blocks ({format_size(nbytes)}) of namespace {ns.hex()[:16]}?"
        ):
            err.print("Nothing deleted.")
            if as_json:  # still one JSON document
                fields = {"namespace": ns.hex(), "deleted_blocks": 0, "deleted_bytes": 0, "declined": True}
                _print_fields(f"clear {path}", fields, as_json)
            raise typer.Exit(EXIT_FOUND_CORRUPT)
        removed = _delete(store, [m.key for m in victims], "deleting")
    fields = {"namespace": ns.hex(), "deleted_blocks": removed, "deleted_bytes": nbytes}
    _print_fields(f"clear {path}", fields, as_json)


def _confirmed(question: str) -> bool:
    """The operator's answer on the terminal; no answer (stdin closed or gone) is a no."""
    try:
        # click's confirm writes the prompt's last character through input(), which writes
        # to stdout even with err=True: stdout must carry the command's output alone.
        with contextlib.redirect_stdout(sys.stderr):
            return typer.confirm(question, err=True)
    except (typer.Abort, EOFError, RuntimeError, OSError):  # RuntimeError: "lost sys.stdin"
        return False


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
    is checked against its key and its seal under DIR's key, and what cannot be read or
    fails is skipped and counted. The fresh store has a new key: what is salvaged is
    re-sealed under it. Needs the writer lock: stop the server first. A store on a
    read-only filesystem is repaired with --out only.
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
        "first_problem": result.problems[0] if result.problems else None,
    }
    _print_fields(f"repair {path}", fields, as_json)


# The commands of their own modules register on ``app`` when imported.
