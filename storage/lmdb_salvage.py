"""The entries of a damaged ``data.mdb`` that can still be read: what repair salvages.

The file is read with ``pread``, never mapped (:class:`storage.lmdb_file.DataFile`), and
each page is checked before it is used, as :func:`storage.lmdb_file.check_structure` does:
what is wrong goes to the salvage's ``problems`` and the bad page or node is skipped. An
entry found is only bytes: :meth:`storage.lmdb_repair.Repair.repair` checks each one against
its key and seal.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from storage.base import KEY_SIZE
from storage.lmdb_file import P_INVALID, P_LEAF, PAGE, DataFile, Db, Meta, Walk


class Found(NamedTuple):
    """An entry :class:`Salvage` found. ``value`` is None when its bytes cannot be read;
    ``scanned`` when it was found by scanning pages, so it may belong to another db."""

    key: bytes
    value: bytes | None
    scanned: bool


@contextlib.contextmanager
def salvage(path: str | os.PathLike[str], db: bytes) -> Iterator[Salvage]:
    """The entries of database ``db`` in a damaged ``<path>/data.mdb``, read defensively
    (see :class:`Salvage`)."""
    with DataFile.open(Path(path)) as file:
        yield Salvage(file, db.decode("ascii"))


class Salvage:
    """Finds the entries of one named database that can still be read.

    First the tree of the newest meta page that leads to the database; if that tree or a
    meta page was damaged (an older meta page leads to an older tree), then every other
    leaf page of the file, for entries with block keys (64 bytes). The scan may find
    older copies of records and records deleted since: still valid KV for their keys.
    ``expected`` is what the db claims to hold (``None`` if unknown); ``problems`` fills
    as :meth:`entries` goes.
    """

    def __init__(self, file: DataFile, name: str) -> None:
        self._file = file
        self._name = name
        metas, self.problems = file.metas()
        self._walk: Walk | None = None
        self._db: Db | None = None
        for meta in metas:
            walk = Walk(file, meta, self.problems)
            db = walk.named_dbs(meta.main).get(name)
            if db is not None:
                self._walk, self._db = walk, db
                break
        self.expected = self._db.entries if self._db is not None else None
        self._page_size = metas[0].page_size if metas else 4096

    def entries(self) -> Iterator[Found]:
        """Keys with their values (None when the bytes cannot be read). A scan may find a
        key again (another db's entry, an older copy): the caller keeps the one it wants."""
        walk = self._walk
        if walk is not None and self._db is not None:
            for node in walk.leaves(self._name, self._db):
                yield Found(node.key, walk.value(self._name, node), scanned=False)
            if not self.problems:
                return
        self.problems.append(f"the {self._name} db is damaged: scanning every page for entries")
        pages = self._file.size // self._page_size
        scan = Walk(self._file, Meta(0, self._page_size, pages - 1, 0, _EMPTY, _EMPTY), [])
        for pgno in range(2, pages):
            if walk is not None and walk.owners.is_tree(pgno):
                continue
            page = self._file.read(pgno * self._page_size, self._page_size)
            if page is None or PAGE.unpack_from(page)[2] != P_LEAF:
                continue
            for node in scan.nodes("scan", pgno, page, leaf=True):
                if len(node.key) == KEY_SIZE:
                    yield Found(node.key, scan.value("scan", node), scanned=True)


_EMPTY = Db(0, 0, 0, P_INVALID, 0)
