"""``tiered-kv storage tree`` (alias ``inspect``): a store's records as prefix trees, each
block under its parent, optionally with its text. Registered on :data:`storage_cli.app`."""
from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.tree import Tree

from storage.lmdb_store import LmdbStore
from tiered_kv.storage_cli import (
    AsJson, Dir, Namespace, _fail, _open, _progress, _resolve_namespace, app, out,
)
from tiered_kv.units import format_size


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
    total = sum(1 for _ in store.metadata(namespace))
    with _progress(f"reading {namespace.hex()[:16]}", total) as bar:
        task = bar.add_task("", total=total)
        records = store.verified_records(namespace, progress=lambda n: bar.advance(task, n))
        for key, record, data in records:
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
    return roots, len(nodes), len(records.unreadable)


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
        spaces = [_resolve_namespace(store, namespace)] if namespace is not None else store.namespaces()
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


