"""Which owner each page of ``data.mdb`` belongs to, as a walk of the file meets them.

Past the two meta pages, every page of a sound file has one owner: a page of one db's
B-tree, a run of overflow pages that holds one value, or the free list (LMDB's own audit
counts them to the last page). A page with two owners is damage LMDB never notices: when
one owner lets it go (a value deleted or replaced, ``gc``), the page goes on the free list
and the next write overwrites the other owner's bytes.

One byte a page: 0 while unclaimed, else ``db number << 2 | kind`` (the free list's
pages: number 0)::

    run at page 40 of 3 pages, then a tree page:  40 RUN | 41 RUN_PAGE | 42 RUN_PAGE | 43 TREE

A run claims its pages up to the first one another owner holds, so the owner of a
``RUN_PAGE`` is the nearest ``RUN`` of its db before it.

A page no owner claims is leaked. LMDB puts every page it stops using on the free list: a
commit lists the pages it freed under its own txnid (the newest commits' too, pages older
snapshots may still read), and those it took from the list but did not use under the
txnids it took them from. So a sound file has none (LMDB's own audit counts the same). A
leaked page is no danger to the others, but it is never reused, and LMDB's compacting copy
refuses the file.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

_TREE, _RUN, _RUN_PAGE, _FREE = range(4)  # a mark's low two bits
_MAX_NUMBER = 63  # a mark's other six bits: the 63rd db and any later ones share 63


class Leak(NamedTuple):
    """Pages that no owner claims: how many, and the first few of them."""

    pages: int
    first: tuple[int, ...]

    def listed(self) -> str:
        """The first pages, then "..." if there are more: ``40, 41, 57, ...``."""
        more = ", ..." if self.pages > len(self.first) else ""
        return ", ".join(map(str, self.first)) + more


class PageOwners:
    """The owners of pages ``0 .. pages - 1``; pages past them (past the end of a
    truncated file) are never claimed: nothing is there to overwrite."""

    def __init__(self, pages: int) -> None:
        self._marks = bytearray(pages)
        self._numbers: dict[str, int] = {}  # db name: its number in the marks

    def owner(self, page: int) -> str | None:
        """What already owns ``page``, in words; None if nothing does."""
        mark = self._marks[page] if page < len(self._marks) else 0
        if not mark:
            return None
        kind, number = mark & 3, mark >> 2
        if kind == _FREE:
            return "the free list"
        names = [name for name, n in self._numbers.items() if n == number]
        db = names[0] if len(names) == 1 else "63rd or later"
        if kind == _TREE:
            return f"the {db} db's tree"
        head = page if kind == _RUN else self._marks.rfind(number << 2 | _RUN, 0, page)
        return f"the {db} db's overflow run at page {head}"

    def is_tree(self, page: int) -> bool:
        """Whether ``page`` was claimed as a page of a db's B-tree."""
        mark = self._marks[page] if page < len(self._marks) else 0
        return mark != 0 and mark & 3 == _TREE

    def claim_tree(self, db: str, page: int) -> None:
        """Claim ``page``, which :meth:`owner` found unclaimed, for ``db``'s B-tree."""
        if page < len(self._marks):
            self._marks[page] = self._number(db) << 2 | _TREE

    def claim_run(self, db: str, first: int, count: int) -> int | None:
        """Claim ``count`` pages from ``first`` for a value of ``db``: the first of them
        another owner already holds (the run keeps only the pages before it), or None."""
        end = min(first + count, len(self._marks))
        if first >= end:
            return None
        marks = self._marks
        unclaimed = end - first
        if marks.count(0, first, end) != unclaimed:
            span = marks[first:end]
            unclaimed = len(span) - len(span.lstrip(b"\0"))
        number = self._number(db) << 2
        if unclaimed:
            marks[first] = number | _RUN
            marks[first + 1 : first + unclaimed] = bytes([number | _RUN_PAGE]) * (unclaimed - 1)
        return first + unclaimed if first + unclaimed < end else None

    def claim_free(self, pages: Iterable[int]) -> int | None:
        """Claim ``pages`` for the free list: the first another owner already holds (the
        others are claimed), or None."""
        marks, size, taken = self._marks, len(self._marks), None
        for page in pages:
            if page >= size:
                continue
            if not marks[page]:
                marks[page] = _FREE
            elif taken is None:
                taken = page
        return taken

    def unclaimed(self, start: int, shown: int = 5) -> Leak:
        """The pages from ``start`` that nothing claimed, the first ``shown`` of them named."""
        marks = self._marks
        first: list[int] = []
        page = marks.find(0, start)
        while page != -1 and len(first) < shown:
            first.append(page)
            page = marks.find(0, page + 1)
        return Leak(marks.count(0, start) if first else 0, tuple(first))

    def _number(self, db: str) -> int:
        return self._numbers.setdefault(db, min(len(self._numbers) + 1, _MAX_NUMBER))
