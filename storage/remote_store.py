"""The remote tier: sealed records in a Valkey or Redis server shared by many engines.

Values are records (:func:`storage.record.encode_record`) sealed under the deployment's
shared key (``seal_key``, from a secret every instance is given), so a record read back is
verified exactly like one read from disk: a value that fails any check (a MAC that does
not verify, another key's seal, damage) is a miss, and once it failed again when read on a
connection opened for it (a reply out of step with its command fails too, see
:meth:`RemoteStore.get_many`), it is counted (``corrupt``) and deleted from the server.
Whoever can write to the server without the secret can delete KV but never make an engine
serve wrong KV. Keys are::

    <prefix><namespace hex>:<block hash hex>        e.g. tkv:9f2c…:03ab…

Network failures never fail a request: every call goes through
:class:`storage.remote_calls.GuardedCalls` (a deadline for the whole call, a cap on the
bytes it reads, a circuit breaker), and every client error is counted and turned into a
miss (lookups) or a drop (stores). :attr:`RemoteStore.available` is false while the
breaker is open and no probe is due.

Puts are synchronous (one pipelined round-trip per :meth:`RemoteStore.put_many`), so a put
is visible as soon as it returns and :meth:`RemoteStore.flush` has nothing to wait for;
callers that must not wait on the network (the engine thread) put from their own thread
(the tier manager's remote writer).

Capacity is the server's business: configure ``maxmemory`` and ``maxmemory-policy
allkeys-lru`` there (and optionally a TTL here). ``stats()`` reports the server's
``used_memory`` and ``maxmemory``, and ``entries`` counts this prefix's keys by ``SCAN``.
A scan walks the whole keyspace, so ``stats()`` never runs one itself: it returns the last
figures and, at most every ``stats_interval_s`` (a minute), starts a refresh in the
background.

The URL names one server (with replicas behind it, if any, managed by the operator) or,
with ``?cluster=1``, a Valkey/Redis Cluster (:mod:`storage.remote_client`). On a cluster,
keys spread over the slots (no hash tag), a pipelined call is split by node, ``SCAN`` and
the memory figures cover every primary that is up, and a node that does not answer costs
only its own keys (:mod:`storage.cluster_pipeline`): they are misses or drops, the other
nodes' answers are kept, the call is a success for the store's breaker, and the node is
skipped, without touching the network, for the breaker's cooldown. The store's breaker
opens only when no node answered (every node the calls needed was down or silent). See
``docs/scale_out.md``.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

from storage.base import DIGEST_SIZE, BlockKey, BlockStore, StoreStats
from storage.call_deadline import CallBytesSpent
from storage.circuit_breaker import BreakerConfig
from storage.record import Record, RecordError, decode_record, encode_record
from storage.remote_calls import GuardedCalls
from storage.remote_url import parse_remote_url, redact_url
from storage.seal import SealKey

__all__ = ["BreakerConfig", "RemoteStore", "parse_remote_url", "redact_url"]

logger = logging.getLogger(__name__)

_GLOB_CHARS = set("*?[]\\")
_SCAN_COUNT = 1000
# A walk of a node ends after this many pages: at _SCAN_COUNT keys a page, more than a node
# of 400 million keys needs (Redis is tested to 250 million). Past it, the server hands out
# new cursors forever.
_MAX_SCAN_PAGES = 1 << 19


class RemoteStore(BlockStore[Record]):
    """Records in a Valkey/Redis server under ``prefix``, sealed under ``seal_key``. See the
    module docstring.

    ``timeout_s`` is the deadline of each call as a whole (connect, send, the whole reply);
    ``ttl_s`` (``None``: none) expires keys on the server; ``breaker`` sets when the
    breaker opens and for how long; ``max_connections`` sizes the client's connection pool;
    ``stats_interval_s``: at most how often :meth:`stats` refreshes its server-side part in
    the background (0: on every call, on the caller's thread).
    """

    tier = "remote"

    def __init__(
        self,
        url: str,
        *,
        seal_key: SealKey,
        prefix: str = "tkv:",
        timeout_s: float = 0.1,
        ttl_s: int | None = None,
        breaker: BreakerConfig | None = None,
        max_connections: int = 16,
        stats_interval_s: float = 60.0,
    ) -> None:
        self.url = parse_remote_url(url)
        if not isinstance(seal_key, SealKey):
            raise ValueError("the remote tier needs the deployment's seal key")  # noqa: TRY004
        self._seal_key = seal_key
        if not prefix or _GLOB_CHARS & set(prefix):
            raise ValueError(f"prefix must be non-empty without glob characters, got {prefix!r}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1):
            raise ValueError(f"ttl_s must be an integer >= 1 or None, got {ttl_s!r}")
        self.prefix = prefix
        self._prefix = prefix.encode("ascii")
        self._ttl = ttl_s
        self._calls = GuardedCalls(
            url, timeout_s=timeout_s, breaker=breaker, max_connections=max_connections
        )
        self._stats_interval = stats_interval_s
        self._lock = threading.Lock()
        self._stats = StoreStats(tier=self.tier)
        self._server_stats_at = -float("inf")
        self._refreshing = False  # a background refresh of the server-side stats is running
        self._closed = False

    # ------------------------------------------------------------------ keys

    def _kb(self, key: BlockKey) -> bytes:
        key.validate()
        return self._prefix + key.namespace.hex().encode() + b":" + key.block_hash.hex().encode()

    def _key_of(self, kb: bytes) -> BlockKey | None:
        ns, _, h = kb[len(self._prefix) :].partition(b":")
        try:
            key = BlockKey(bytes.fromhex(ns.decode()), bytes.fromhex(h.decode()))
        except ValueError:
            return None
        if len(key.namespace) != DIGEST_SIZE or len(key.block_hash) != DIGEST_SIZE:
            return None
        return key

    # ------------------------------------------------------------------ the network

    @property
    def available(self) -> bool:
        """``False`` while the breaker is open and no probe is due: a call now would be a
        miss or a drop without touching the network."""
        return self._calls.available

    # ------------------------------------------------------------------ BlockStore

    def contains(self, key: BlockKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        kbs = [self._kb(k) for k in keys]
        if not kbs:
            return []
        replies = self._calls.pipeline(lambda p: [p.exists(kb) for kb in kbs], len(kbs), "exists")
        return [not isinstance(r, Exception) and bool(r) for r in replies]

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        """One pipelined round-trip of ``EXISTS`` for the whole chain."""
        for i, present in enumerate(self.contains_many(keys)):
            if not present:
                return i
        return len(keys)

    def get(self, key: BlockKey) -> Record | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[BlockKey]) -> list[Record | None]:
        """The records, read and verified; see the module docstring for what a record that
        fails its checks costs. It is deleted only once it failed them on a connection
        opened to read it again: on a pooled one, a reply the server sent too many, or late
        (a proxy's, for a command its client gave up on), shifts every reply after it to
        the next command, and each good record after it would be taken for another key's
        (:mod:`storage.server_pipeline`). Any reply that fails its checks may be the sign of
        such a shift, so every key not served is read again, once."""
        kbs = [self._kb(k) for k in keys]
        if not kbs:
            return []
        out = self._read(keys, kbs)
        again = [i for i, r in enumerate(out) if not isinstance(r, Record)]
        if any(isinstance(out[i], RecordError) for i in again):
            reread = self._read([keys[i] for i in again], [kbs[i] for i in again], fresh=True)
            for i, r in zip(again, reread):
                out[i] = r
            shifted = sum(isinstance(out[i], Record) for i in again)
            if shifted:
                logger.warning(
                    "remote tier: %d records failed their checks and passed them when read "
                    "again on a new connection: a reply out of step with its command (a "
                    "reply too many, from the server or a proxy); nothing deleted", shifted,
                )
        bad = [i for i, r in enumerate(out) if isinstance(r, RecordError)]
        for i in bad:
            logger.warning("remote tier: deleting corrupt record %s: %s", keys[i].short(), out[i])
        served = [r if isinstance(r, Record) else None for r in out]
        hits = len(served) - served.count(None)
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += len(served) - hits
            self._stats.bytes_read += sum(r.nbytes for r in served if r is not None)
            self._stats.corrupt += len(bad)
        if bad:
            self._delete_stored([kbs[i] for i in bad])
        return served

    def _read(self, keys: Sequence[BlockKey], kbs: Sequence[bytes], *,
              fresh: bool = False) -> list[Record | RecordError | None]:
        """Each key's record, the check its reply failed, or ``None`` (:meth:`_verified`),
        from ``GET`` s pipelined. A call reads at most ``MAX_CALL_BYTES``
        (:mod:`storage.call_deadline`): the keys whose replies it did not read
        (``CallBytesSpent``) are asked in a call of their own, and so on while a call reads
        any reply in full. Each call's replies are checked before the next call, and only
        the records kept, so a batch of large records costs more round-trips, and holds no
        more than one call's bytes besides the records asked for."""
        out: list[Record | RecordError | None] = [None] * len(kbs)
        asked = list(range(len(kbs)))
        while asked:
            cut = self._read_call(keys, kbs, asked, out, fresh)
            if len(cut) == len(asked):
                break
            asked = cut
        return out

    def _read_call(self, keys: Sequence[BlockKey], kbs: Sequence[bytes], asked: list[int],
                   out: list, fresh: bool) -> list[int]:
        """One call of :meth:`_read`, for the keys at ``asked``, into ``out``; the keys at
        which the call's bytes ran out. (A function of its own: the call's replies go when
        it returns, before the next call.)"""
        replies = self._calls.pipeline(lambda p: [p.get(kbs[i]) for i in asked], len(asked), "get",
                                 fresh=fresh)
        cut = []
        for i, reply in zip(asked, replies):
            if isinstance(reply, CallBytesSpent):
                cut.append(i)
            else:
                out[i] = self._verified(keys[i], reply)
        return cut

    def _verified(self, key: BlockKey, buf) -> Record | RecordError | None:
        """The record in a reply, the check it fails, or ``None`` for no record (a nil, an
        error: nothing that says the record under the key is bad)."""
        if buf is None or isinstance(buf, Exception):
            return None
        try:
            return decode_record(buf, self._seal_key, key)
        except RecordError as e:
            return e.with_traceback(None)  # its frames hold the reply

    def put(self, key: BlockKey, value: Record) -> bool:
        return self.put_many([(key, value)])[0]

    def put_many(self, items: Iterable[tuple[BlockKey, Record]]) -> list[bool]:
        """Store records in one pipelined round-trip; all ``False`` (dropped) on failure."""
        encoded = []
        for key, record in items:
            kb = self._kb(key)
            if record.key != key:
                raise ValueError(f"record is for {record.key.short()}, put under {key.short()}")
            encoded.append((kb, encode_record(record, self._seal_key)))
        if not encoded:
            return []
        replies = self._calls.pipeline(
            lambda p: [p.set(kb, buf, ex=self._ttl) for kb, buf in encoded], len(encoded), "set"
        )
        stored = [not isinstance(r, Exception) for r in replies]
        with self._lock:
            self._stats.puts += sum(stored)
            self._stats.bytes_written += sum(len(buf) for (_, buf), s in zip(encoded, stored) if s)
            self._stats.dropped += len(stored) - sum(stored)
        return stored

    def delete(self, key: BlockKey) -> bool:
        return self.delete_many([key]) == 1

    def delete_many(self, keys: Sequence[BlockKey]) -> int:
        return self._delete_stored([self._kb(k) for k in keys])

    def _delete_stored(self, kbs: Sequence[bytes]) -> int:
        """Delete keys as named on the server (one ``DEL`` each, pipelined: a cluster's keys are in many
        slots); how many existed."""
        if not kbs:
            return 0
        replies = self._calls.pipeline(lambda p: [p.delete(kb) for kb in kbs], len(kbs), "delete")
        return sum(r == 1 for r in replies)  # anything else, an error or garbage, deleted nothing

    def keys(self, namespace: bytes | None = None) -> Iterator[BlockKey]:
        """Keys under this prefix by ``SCAN`` of the server, or of every primary of a
        cluster, one page per call (stops where the server or a node is unreachable or
        answers something other than a page, at a cursor the walk already passed, after
        ``_MAX_SCAN_PAGES`` pages of a node, and once the store is closed)."""
        pattern = self._prefix + (namespace.hex().encode() + b":" if namespace else b"") + b"*"
        ok, nodes = self._calls.call(lambda r: r.scan_nodes(), "scan")
        if not ok:
            return
        seen: set[bytes] = set()  # SCAN may return a key twice
        for node in nodes:
            cursor: int | None = 0
            visited: set[int] = set()  # a server whose cursors cycle ends the walk
            while (cursor is not None and cursor not in visited and not self._closed
                   and len(visited) < _MAX_SCAN_PAGES):
                visited.add(cursor)
                ok, reply = self._calls.call(
                    lambda r, cur=cursor, node=node: _page(r.scan(node, cur, pattern, _SCAN_COUNT)),
                    "scan",
                )
                if not ok:
                    return
                cursor, batch = reply
                for kb in batch:
                    if kb in seen:
                        continue
                    seen.add(kb)
                    key = self._key_of(kb)
                    if key is not None:
                        yield key
                if cursor == 0:
                    cursor = None

    def stats(self) -> StoreStats:
        """The counters, and the server's key count and memory as of the last refresh. A
        refresh (a ``SCAN`` of the whole keyspace) is due every ``stats_interval_s`` and runs
        on a background thread, so this never waits on the server; with an interval of 0 it
        runs here, every call."""
        now = time.monotonic()
        with self._lock:
            due = now - self._server_stats_at >= self._stats_interval and not self._refreshing
            if due:
                self._server_stats_at = now
                self._refreshing = self._stats_interval > 0
        if due and self._stats_interval <= 0:
            if self.available:
                self._refresh_server_stats()
        elif due:
            threading.Thread(
                target=self._refresh_in_background, name="tiered-kv-remote-stats", daemon=True
            ).start()
        with self._lock:
            return dataclasses.replace(self._stats)

    def _refresh_in_background(self) -> None:
        try:
            if not self._closed and self.available:
                self._refresh_server_stats()
        finally:
            with self._lock:
                self._refreshing = False

    def _refresh_server_stats(self) -> None:
        ok, memory = self._calls.call(lambda r: r.memory(), "info")
        if not ok:
            return
        entries = sum(1 for _ in self.keys())
        with self._lock:
            self._stats.entries = entries
            self._stats.bytes_used, self._stats.capacity_bytes = memory

    def close(self) -> None:
        """Release the connection pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._calls.close()


def _page(reply) -> tuple[int, list[bytes]]:
    """A ``SCAN`` reply checked: the next cursor and the keys that are strings. Raises for
    anything else (the walk ends there)."""
    cursor, keys = reply
    if not isinstance(cursor, int) or not isinstance(keys, list):
        raise ValueError(f"not a SCAN page: {reply!r:.100}")
    return cursor, [k for k in keys if isinstance(k, bytes)]
