"""``data.mdb`` read with ``pread``, never mapped: damage becomes a report, never a signal.

LMDB maps the data file and follows the page numbers and offsets it finds there without
bounds checks: a truncated file kills the process with SIGBUS at the first touch past its
end, and a damaged page can send a read anywhere. So the file is checked here first:

- :func:`check_data_file`: the two meta pages and the file size; cheap, run by every open;
- :func:`check_structure`: every page reachable from the committed meta; one read of the
  B-tree pages and of each overflow run's page header (not of the values), for admin tools
  that read everything; a page two owners claim (:mod:`storage.lmdb_pages`) is damage too,
  a page below the last one that no owner claims is leaked (reported, not damage).

Salvaging the entries of a damaged file that can still be read (repair) is
:mod:`storage.lmdb_salvage`.

The on-disk format of LMDB 0.9 (64-bit, native byte order)::

    page   0 u64 pgno | 8 u16 pad | 10 u16 flags | 12 u16 lower | 14 u16 upper
           16 u16 ptrs[(lower - 16) / 2]: node offsets from the page start, each >= upper
           (an overflow page has a u32 page count at 12 and its data from 16)
    node   0 u16 lo | 2 u16 hi | 4 u16 flags | 6 u16 key size | 8 key | data
           leaf: data size is lo | hi << 16; F_BIGDATA: the data is the u64 first page
           of an overflow run. branch: the child page is lo | hi << 16 | flags << 32
    meta   pages 0 and 1, from 16: u32 magic | u32 version | u64 address | u64 map size
           | db free (48) | db main (48) | u64 last page | u64 txnid; the newest txnid wins
    db     u32 pad (the page size, in a meta's free db) | u16 flags | u16 depth
           | u64 branch, leaf, overflow pages | u64 entries | u64 root page
"""
from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from storage.base import StoreError
from storage.lmdb_pages import Leak, PageOwners

DATA_NAME = "data.mdb"
MAGIC = 0xBEEFC0DE
DATA_VERSION = 1  # LMDB 0.9's format; py-lmdb builds it unless lib_version says otherwise
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
F_BIGDATA, F_SUBDATA = 0x01, 0x02
P_INVALID = (1 << 64) - 1  # the root of an empty db
MAX_DEPTH = 32  # LMDB's cursor stack
MAX_KEY_SIZE = 511
_MAX_PROBLEMS = 100
_MIN_PAGE, _MAX_PAGE = 256, 0x8000

PAGE = struct.Struct("=QHHHH")  # pgno, pad, flags, lower, upper
_HEADER = PAGE.size
_NODE = struct.Struct("=HHHH")  # lo, hi, flags, key size
_META = struct.Struct("=II8xQ")  # magic, version, (address), map size
_DB = struct.Struct("=IHH24xQQ")  # pad, flags, depth, (page counts), entries, root
_TAIL = struct.Struct("=QQ")  # last page, txnid
_META_END = _HEADER + _META.size + 2 * _DB.size + _TAIL.size
_U64 = struct.Struct("=Q")


class DamagedStore(StoreError):
    """``data.mdb`` is truncated or damaged: LMDB must not map it. ``tiered-kv storage
    repair`` salvages what can still be read."""


class Db(NamedTuple):
    flags: int
    depth: int
    entries: int
    root: int
    pad: int


class Meta(NamedTuple):
    page: int  # 0 or 1
    page_size: int
    last_page: int
    txnid: int
    free: Db
    main: Db


class FileCheck(NamedTuple):
    """What :func:`check_structure` found."""

    problems: list[str]  # damage: LMDB must not map the file
    # Pages up to the last one that no tree, value or free list claims: lost space, no
    # damage. Counted only in a file without problems: a bad link hides the pages past it.
    leaked: Leak


class _Overflow(NamedTuple):
    page: int
    size: int


class _Node(NamedTuple):
    key: bytes
    flags: int
    data: bytes | _Overflow | int  # inline value, overflow run, or (branch) child page


class DataFile:
    """The data file opened for ``pread``; :meth:`read` gives ``None`` past its end."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    @classmethod
    @contextlib.contextmanager
    def open(cls, path: Path) -> Iterator[DataFile]:
        try:
            fd = os.open(path / DATA_NAME, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise StoreError(f"cannot read {path / DATA_NAME}: {e.strerror}") from None
        try:
            yield cls(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def read(self, offset: int, size: int) -> bytes | None:
        if offset + size > self.size:
            return None
        data = os.pread(self.fd, size, offset)
        return data if len(data) == size else None

    def meta(self, page: int, page_size: int) -> Meta | str:
        """Meta page ``page``, or what is wrong with it."""
        raw = self.read(page * page_size, _META_END)
        if raw is None:
            return f"meta page {page} lies past the end of the file"
        pgno, _, flags, _, _ = PAGE.unpack_from(raw)
        magic, version, _ = _META.unpack_from(raw, _HEADER)
        if not flags & P_META or pgno != page:
            return f"page {page} is not a meta page"
        if magic != MAGIC:
            return f"meta page {page} has a bad magic number {magic:#x}"
        if version != DATA_VERSION:
            return f"meta page {page} is LMDB data version {version}, not {DATA_VERSION}"
        at = _HEADER + _META.size
        free, main = (_db(raw, at), _db(raw, at + _DB.size))
        last_page, txnid = _TAIL.unpack_from(raw, at + 2 * _DB.size)
        if free.pad & (free.pad - 1) or not _MIN_PAGE <= free.pad <= _MAX_PAGE:
            return f"meta page {page} has an impossible page size {free.pad}"
        return Meta(page, free.pad, last_page, txnid, free, main)

    def metas(self) -> tuple[list[Meta], list[str]]:
        """The readable meta pages, newest first, and what is wrong with the others."""
        first = self.meta(0, 1)
        second = self.meta(1, first.page_size if isinstance(first, Meta) else 4096)
        good = [m for m in (first, second) if isinstance(m, Meta)]
        problems = [m for m in (first, second) if isinstance(m, str)]
        if len(good) == 2 and good[0].page_size != good[1].page_size:
            problems.append("the meta pages disagree on the page size")
        return sorted(good, key=lambda m: m.txnid, reverse=True), problems

    def committed(self) -> Meta:
        """The meta page LMDB would use, checked against the file: :class:`DamagedStore`
        if LMDB would refuse the file or read past its end."""
        metas, problems = self.metas()
        if problems:
            raise DamagedStore(problems[0])
        meta = metas[0]
        needed = (meta.last_page + 1) * meta.page_size
        if meta.last_page < 1:
            raise DamagedStore(f"meta page {meta.page} names last page {meta.last_page}")
        if self.size < needed:
            raise DamagedStore(
                f"truncated: the file is {self.size:,} bytes, its meta page {meta.page} "
                f"needs {needed:,}"
            )
        for name, db in (("free", meta.free), ("main", meta.main)):
            if db.root != P_INVALID and not 2 <= db.root <= meta.last_page:
                raise DamagedStore(f"meta page {meta.page}: the {name} db's root is page {db.root}")
            if db.depth > MAX_DEPTH:
                raise DamagedStore(f"meta page {meta.page}: the {name} db is {db.depth} deep")
        return meta


def check_data_file(path: str | os.PathLike[str]) -> Meta | None:
    """Check ``<path>/data.mdb`` against its meta pages before anything maps it.

    Returns the committed meta (``None`` for a missing or empty file, which LMDB
    initialises); raises :class:`DamagedStore` for bad magic or version, an impossible
    page size or root, or a file shorter than its last used page.
    """
    path = Path(path)
    if not (path / DATA_NAME).exists():
        return None
    with DataFile.open(path) as file:
        for _ in range(3):
            file.size = os.fstat(file.fd).st_size
            if file.size == 0:
                return None
            try:
                return file.committed()
            except DamagedStore as e:
                damage = e
            time.sleep(0.01)  # a writer in another process may be midway through a meta page
    raise DamagedStore(f"{path / DATA_NAME} is damaged: {damage}")


def check_structure(path: str | os.PathLike[str]) -> FileCheck | None:
    """Every page LMDB could reach from the committed meta, checked as LMDB trusts it.

    Returns what is wrong (no problems: LMDB can read the file safely) and the pages no one
    claims, or None if a writer in another process committed during each of three walks:
    LMDB never rewrites a page the newest commit can reach, so a walk is sound only if no
    commit came during it. :class:`DamagedStore` if the meta pages are bad.
    """
    path = Path(path)
    damage: DamagedStore | None = None
    with DataFile.open(path) as file:
        for _ in range(3):
            file.size = os.fstat(file.fd).st_size
            try:
                meta = file.committed()
            except DamagedStore as e:
                damage = e
                time.sleep(0.01)  # a writer in another process may be midway through a meta page
                continue
            damage = None
            check = _walk_all(file, meta)
            # A writer may have committed (and grown the file) during the walk: read the
            # meta pages again against the file as it is now.
            file.size = os.fstat(file.fd).st_size
            try:
                if file.committed().txnid == meta.txnid:
                    return check
            except DamagedStore:
                pass  # midway through the next commit: walk again
    if damage is not None:
        raise DamagedStore(f"{path / DATA_NAME} is damaged: {damage}")
    return None


def _walk_all(file: DataFile, meta: Meta) -> FileCheck:
    walk = Walk(file, meta)
    for node in walk.leaves("free", meta.free):
        value = walk.value("free", node)
        if value is None:
            continue
        pages = struct.unpack_from(f"={len(value) // 8}Q", value)
        listed = f"free db: the page list of txn {node.key.hex()}"
        if not pages or pages[0] != len(pages) - 1 or len(value) % 8:
            walk.problem(f"{listed} is malformed")
        elif any(not 2 <= page < walk.next_page for page in pages[1:]):
            walk.problem(f"{listed} names a bad page")
        elif (taken := walk.owners.claim_free(pages[1:])) is not None:
            walk.overlap(f"{listed} names page {taken} of", taken)
    for name, db in walk.named_dbs(meta.main).items():
        previous: bytes | None = None
        for node in walk.leaves(name, db):
            if isinstance(node.data, _Overflow):
                walk.overflow_page(name, node.data)
            # LMDB finds a key by binary search in memcmp order: one out of order (a flipped
            # byte) hides itself and its neighbours from every lookup
            if previous is not None and node.key <= previous:
                walk.problem(f"{name} db: key {node.key[:8].hex()}... is out of order")
            previous = node.key
    if walk.problems:
        return FileCheck(walk.problems, Leak(0, ()))
    return FileCheck(walk.problems, walk.owners.unclaimed(2))  # past the meta pages


class Walk:
    """Walks B-trees from one meta page, checking every page before using it. What is
    wrong goes to ``problems`` and the bad page or node is skipped. Each page met is
    claimed in ``owners``: a tree page another owner holds is skipped (it may close a
    cycle), a value on pages another owner holds is still read."""

    def __init__(self, file: DataFile, meta: Meta, problems: list[str] | None = None) -> None:
        self.file = file
        self.page_size = meta.page_size
        self.next_page = meta.last_page + 1
        self.problems = problems if problems is not None else []
        self.owners = PageOwners(min(self.next_page, file.size // self.page_size))

    def problem(self, text: str) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(text)

    def overlap(self, claimant: str, page: int) -> None:
        """``claimant`` claims ``page``, which has an owner: the problem names both."""
        if len(self.problems) < _MAX_PROBLEMS:  # naming the owner may search through a run
            self.problems.append(f"{claimant} {self.owners.owner(page)}")

    def named_dbs(self, main: Db) -> dict[str, Db]:
        """The named databases listed in the main db."""
        found: dict[str, Db] = {}
        for node in self.leaves("main", main):
            data = node.data
            if node.flags == F_SUBDATA and isinstance(data, bytes) and len(data) == _DB.size:
                db = _db(data, 0)
                if db.flags == 0 and db.depth <= MAX_DEPTH and (
                    db.root == P_INVALID or 2 <= db.root < self.next_page
                ):
                    found[node.key.decode("ascii", "replace")] = db
                    continue
            self.problem(f"main db: the entry {node.key[:32]!r} is not a valid database")
        return found

    def leaves(self, name: str, db: Db) -> Iterator[_Node]:
        """The leaf nodes of a db, in key order."""
        if db.root == P_INVALID:
            return
        stack = [(db.root, 1)]
        while stack:
            pgno, depth = stack.pop()
            page = self._page(name, pgno, depth)
            if page is None:
                continue
            if PAGE.unpack_from(page)[2] == P_BRANCH:
                children = [node.data for node in self.nodes(name, pgno, page, leaf=False)]
                stack.extend((child, depth + 1) for child in reversed(children))
            else:
                yield from self.nodes(name, pgno, page, leaf=True)

    def nodes(self, name: str, pgno: int, page: bytes, *, leaf: bool) -> Iterator[_Node]:
        """The nodes of one page whose header, key and inline data lie within it."""
        _, _, _, lower, upper = PAGE.unpack_from(page)
        if not _HEADER <= lower <= upper <= self.page_size or (lower - _HEADER) % 2:
            self.problem(f"{name} db: page {pgno} has bounds {lower}..{upper}")
            return
        for i in range((lower - _HEADER) // 2):
            (at,) = struct.unpack_from("=H", page, _HEADER + 2 * i)
            if not upper <= at <= self.page_size - _NODE.size:
                self.problem(f"{name} db: page {pgno} node {i} lies outside the page")
                continue
            lo, hi, flags, key_size = _NODE.unpack_from(page, at)
            key_end = at + _NODE.size + key_size
            if key_size > MAX_KEY_SIZE or key_end > self.page_size:
                self.problem(f"{name} db: page {pgno} node {i} has a key of {key_size} bytes")
                continue
            key = page[at + _NODE.size : key_end]
            size = lo | hi << 16
            if not leaf:
                yield _Node(key, 0, size | flags << 32)
            elif flags == F_BIGDATA and key_end + 8 <= self.page_size:
                yield _Node(key, flags, _Overflow(_U64.unpack_from(page, key_end)[0], size))
            elif flags in (0, F_SUBDATA) and key_end + size <= self.page_size:
                yield _Node(key, flags, page[key_end : key_end + size])
            else:
                self.problem(f"{name} db: page {pgno} node {i} has flags {flags:#x}, {size} bytes")

    def value(self, name: str, node: _Node) -> bytes | None:
        """A leaf node's value: inline, or read from its overflow run; None if unreadable."""
        if isinstance(node.data, bytes):
            return node.data
        run = node.data
        if not self.overflow_page(name, run):
            return None
        return self.file.read(run.page * self.page_size + _HEADER, run.size)

    def overflow_page(self, name: str, run: _Overflow) -> bool:
        """Whether an overflow run is where its node says, whole, and within the file.

        LMDB reads the value without looking at the run's page header, but frees as many
        pages as the header counts when the value is deleted or replaced: a count past the
        last page would put pages that do not exist on the free list, and one over pages
        another owner holds would hand them to the next write. Such a run is still read:
        the value is where its node says, and its seal tells whether the bytes are its own."""
        end = run.page * self.page_size + _HEADER + run.size
        if run.page < 2 or end > min(self.file.size, self.next_page * self.page_size):
            self.problem(f"{name} db: the overflow value at page {run.page} runs past the file")
            return False
        head = self._page(name, run.page, 1, overflow=True)
        if head is None:
            return False
        (pages,) = struct.unpack_from("=I", head, 12)
        if pages < -(-(_HEADER + run.size) // self.page_size):
            self.problem(f"{name} db: the overflow run at page {run.page} is cut short")
            return False
        if run.page + pages > self.next_page:
            self.problem(
                f"{name} db: the overflow run at page {run.page} counts {pages} pages, "
                "past the last page"
            )
            return False
        taken = self.owners.claim_run(name, run.page, pages)
        if taken is not None:
            self.overlap(
                f"{name} db: the overflow run at page {run.page} overlaps page {taken} of", taken
            )
        return True

    def _page(self, name: str, pgno: int, depth: int, *, overflow: bool = False) -> bytes | None:
        if not 2 <= pgno < self.next_page or depth > MAX_DEPTH:
            self.problem(f"{name} db: a link to page {pgno} leads outside the tree")
            return None
        if not overflow and self.owners.owner(pgno) is not None:  # met again: maybe a cycle
            self.overlap(f"{name} db: a link to page {pgno} leads into", pgno)
            return None
        # An overflow page's header is all there is to check: its data is the value.
        page = self.file.read(pgno * self.page_size, _HEADER if overflow else self.page_size)
        if page is None:
            self.problem(f"{name} db: page {pgno} lies past the end of the file")
            return None
        stored, _, flags, _, _ = PAGE.unpack_from(page)
        if stored != pgno or flags not in ((P_OVERFLOW,) if overflow else (P_BRANCH, P_LEAF)):
            self.problem(f"{name} db: page {pgno} is not the page its link expects")
            return None
        if not overflow:
            self.owners.claim_tree(name, pgno)
        return page


def _db(raw: bytes, at: int) -> Db:
    pad, flags, depth, entries, root = _DB.unpack_from(raw, at)
    return Db(flags, depth, entries, root, pad)
