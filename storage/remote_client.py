"""How the remote tier reaches Valkey/Redis: a client for one server or a cluster (its URL:
:mod:`storage.remote_url`).

A cluster URL names the node to start from. The client asks it for the slot map (``CLUSTER
SLOTS``), learns the other nodes, follows ``MOVED`` and ``ASK`` redirections, and splits a
pipeline by node (:mod:`storage.cluster_pipeline`): the commands for every node are sent
before any reply is read, so a pipelined call costs about one round-trip whichever nodes it
touches, and a node that does not answer fails only its own commands; it is skipped until
its cooldown has passed. Keys are hashed whole (no ``{hash tag}``), so blocks spread evenly
over the 16384 slots and the nodes that own them. A cluster has only database 0.

Both clients talk through the call deadline's connections (:mod:`storage.call_deadline`)
and never retry on their own: the remote store's circuit breaker decides when to try
again. A cluster client is built on the first call (building it asks a node for the slot
map, so it happens under that call's deadline, and only for the slot map: not for the
server's command table, see :class:`_Cluster`); the probe that may close the store's
breaker rebuilds it from the URL's node and every node it knew, because the library forgets
the nodes it saw fail: a node that answers the slot map passes the probe.
"""
from __future__ import annotations

import abc
import functools
import logging
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import valkey
from valkey.backoff import NoBackoff
from valkey.cluster import ClusterNode, ValkeyCluster
from valkey.exceptions import InvalidResponse
from valkey.retry import Retry

from storage import server_pipeline
from storage.call_deadline import CallDeadline, connection_class
from storage.circuit_breaker import Permit
from storage.cluster_pipeline import NO_ANSWER, NodeBreakers, NodeDown, send
from storage.remote_url import is_cluster_url, without_cluster

SLOTS = 16384

logger = logging.getLogger(__name__)

# A cluster node whose INFO has no memory figures is named in a WARNING at most this often.
LEFT_OUT_WARNING_S = 600.0

# The commands the tier sends, each naming its one key first, as ``COMMAND`` describes them
# (arity, flags, first key, last key, step): all the library needs to route them.
_COMMANDS = {
    "get": (2, ["readonly", "fast"], 1, 1, 1),
    "set": (-3, ["write", "denyoom"], 1, 1, 1),
    "exists": (-2, ["readonly", "fast"], 1, -1, 1),
    "del": (-2, ["write"], 1, -1, 1),
}


class RemoteClient(abc.ABC):
    """The client of one server or of a cluster, seen the same way by the remote store.
    Every method touches the network: call them under the store's deadline."""

    @abc.abstractmethod
    def pipeline(self, queue: Callable[[valkey.client.Pipeline], object], *,
                 fresh: bool = False) -> list:
        """The replies of the commands ``queue(pipe)`` queues, each naming one key first,
        sent in one pipelined round-trip (per node, on a cluster): a reply is the exception
        where its command failed (the server refused it, its node did not answer or is
        down, the call read its bytes before it: ``CallBytesSpent``). Raises if no
        server or node answered. ``fresh``: on connections opened for this call and closed
        after it, which no reply of an earlier call can reach (see
        :mod:`storage.server_pipeline`); a redirected command is then not followed."""

    @abc.abstractmethod
    def probe(self) -> None:
        """A cheap check that the server answers (``PING``), or some node of a cluster (the
        slot map); raises if none does."""

    @abc.abstractmethod
    def scan_nodes(self) -> list[str]:
        """The nodes to ``SCAN`` to see every key: the server, or each primary by name."""

    @abc.abstractmethod
    def scan(self, node: str, cursor: int, match: bytes, count: int) -> tuple[int, list[bytes]]:
        """One ``SCAN`` page of ``node``: the next cursor (0: done) and the keys."""

    @abc.abstractmethod
    def memory(self) -> tuple[int, int]:
        """``used_memory`` and ``maxmemory``, summed over the primaries."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drop the connections."""


class ServerClient(RemoteClient):
    """One server (with replicas behind it, if any, the operator's business). Connects on
    the first call."""

    def __init__(self, url: str, deadline: CallDeadline, *, timeout_s: float,
                 max_connections: int) -> None:
        self._client = valkey.Valkey.from_url(
            without_cluster(url),
            connection_class=connection_class(url),
            call_deadline=deadline,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,
            retry=Retry(NoBackoff(), 0),  # the breaker decides when to try again
            retry_on_timeout=False,
        )

    def pipeline(self, queue: Callable[[valkey.client.Pipeline], object], *,
                 fresh: bool = False) -> list:
        pipe = self._client.pipeline(transaction=False)
        queue(pipe)
        return server_pipeline.send(self._client, pipe.command_stack, fresh=fresh)

    def probe(self) -> None:
        self._client.ping()

    def scan_nodes(self) -> list[str]:
        return ["server"]

    def scan(self, node: str, cursor: int, match: bytes, count: int) -> tuple[int, list[bytes]]:
        return self._client.scan(cursor, match=match, count=count)

    def memory(self) -> tuple[int, int]:
        return _memory_figures(self._client.info("memory"))

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()


def _memory_figures(info: dict) -> tuple[int, int]:
    """``used_memory`` and ``maxmemory`` of one server's ``INFO memory``. Raises
    ``ValueError`` for a figure no server reports (negative, past 64 bits): the figures
    reach the metrics, where a number past a float's range fails every scrape."""
    used, limit = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
    if not (0 <= used < 1 << 64 and 0 <= limit < 1 << 64):
        raise ValueError("INFO memory reports a figure out of range")
    return used, limit


class _Cluster(ValkeyCluster):
    """A ``ValkeyCluster`` that does not ask a node for the server's command table.

    The library reads ``COMMAND`` when it is built, to find the keys of any command: a
    90 KB reply parsed in Python, 0.1-0.4 s on a busy 2-core host, inside the deadline of
    the call that builds the client (the first one, and every probe), 0.1 s by default.
    It ate the deadline, the nodes were marked down without being asked, and on such a
    host the tier never came up; a user limited to the tier's commands (see the ACL in
    docs/scale_out.md) may not run ``COMMAND`` at all. Here the table is that of the
    commands the tier sends; the library asks a node for the full one if it ever meets
    another (its ``CommandsParser``)."""

    def command(self, **kwargs) -> dict:
        return {
            name: dict(name=name, arity=arity, flags=flags, first_key_pos=first,
                       last_key_pos=last, step_count=step)
            for name, (arity, flags, first, last, step) in _COMMANDS.items()
        }


class _SlotMapChecked:
    """A connection that checks a ``CLUSTER SLOTS`` reply before the library reads it: the
    library makes an entry for every slot of every range it names, so one range of 10**11
    slots from a broken or hostile node would take minutes and gigabytes."""

    _asked_slots = False

    def send_command(self, *args, **kwargs) -> None:
        self._asked_slots = args[:1] == ("CLUSTER SLOTS",)
        super().send_command(*args, **kwargs)

    def read_response(self, *args, **kwargs):
        reply = super().read_response(*args, **kwargs)
        asked, self._asked_slots = self._asked_slots, False
        if asked:
            _check_slot_map(reply)
        return reply


def _check_slot_map(reply) -> None:
    """Raises unless each range of a ``CLUSTER SLOTS`` reply is two slot numbers in order,
    and the ranges hold at most every slot once."""
    if not isinstance(reply, list):
        raise InvalidResponse(f"CLUSTER SLOTS replied {reply!r:.100}")
    total = 0
    for entry in reply:
        first, last = entry[:2] if isinstance(entry, list) and len(entry) >= 2 else (None, None)
        if not (isinstance(first, int) and isinstance(last, int) and 0 <= first <= last < SLOTS):
            raise InvalidResponse(f"CLUSTER SLOTS names the range {entry!r:.100}")
        total += last - first + 1
    if total > SLOTS:
        raise InvalidResponse(f"CLUSTER SLOTS names {total} slots")


@functools.cache
def _cluster_connection(connection: type[valkey.Connection]) -> type[valkey.Connection]:
    return type(f"Cluster{connection.__name__}", (_SlotMapChecked, connection), {})


class ClusterClient(RemoteClient):
    """A Valkey/Redis Cluster; see the module docstring. A node that does not answer is
    down for ``cooldown_s``. Thread-safe."""

    def __init__(self, url: str, deadline: CallDeadline, *, timeout_s: float,
                 max_connections: int, cooldown_s: float) -> None:
        self._url = without_cluster(url)
        self._deadline = deadline
        self._nodes = NodeBreakers(cooldown_s)
        self._refresh_slots = False  # a node went down: ask a node that is up for the slot map
        start = urlsplit(url)
        self._start = (start.hostname, start.port or 6379)  # the URL's node
        tls_or_tcp = _cluster_connection(connection_class(url))

        def pool(**kwargs) -> valkey.ConnectionPool:
            # The library puts its own class for a TLS URL here; ours bounds every wait.
            kwargs["connection_class"] = tls_or_tcp
            return valkey.ConnectionPool(call_deadline=deadline, **kwargs)

        self._options = dict(
            connection_pool_class=pool,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,  # per node
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        self._lock = threading.Lock()
        self._figures_left_out = 0  # nodes' memory figures left out since the last WARNING
        self._left_out_warned_at = -LEFT_OUT_WARNING_S
        self._cluster: ValkeyCluster | None = None
        self._known: list[tuple[str, int]] = []  # nodes of the last client, to start from

    def client(self) -> ValkeyCluster:
        with self._lock:
            if self._cluster is None:
                # Nodes that went down are asked for the slot map last: one that takes the
                # connection and never answers would spend every probe's deadline.
                seeds = sorted(
                    (ClusterNode(host, port) for host, port in [*self._known, self._start]),
                    key=lambda node: self._nodes.is_down(node.name),
                )
                self._cluster = _Cluster(url=self._url, startup_nodes=seeds,
                                         cluster_error_retry_attempts=0,  # the breakers decide
                                         **self._options)
            return self._cluster

    def pipeline(self, queue: Callable[[valkey.client.Pipeline], object], *,
                 fresh: bool = False) -> list:
        cluster = self.client()
        if self._refresh_slots:
            self._refresh_slots = False
            self._ask_slots(cluster)
        pipe = cluster.pipeline(transaction=False)
        queue(pipe)
        sent = send(cluster, pipe.command_stack, self._nodes, self._deadline, fresh=fresh)
        if sent.went_down:
            self._refresh_slots = True
        if not sent.answered:
            raise next((r for r in sent.replies if isinstance(r, Exception)),
                       NodeDown("no node of the cluster answered"))
        return sent.replies

    def _ask_slots(self, cluster: ValkeyCluster) -> None:
        """Read the slot map again, from a node that is up (those down are asked last)."""
        manager = cluster.nodes_manager
        manager.startup_nodes = dict(
            sorted(manager.startup_nodes.items(), key=lambda item: self._nodes.is_down(item[0]))
        )
        try:
            manager.initialize()
        except valkey.ValkeyError as e:  # the old map stays
            logger.debug("remote tier: could not read the cluster's slot map: %s", e)

    def probe(self) -> None:
        self._forget()
        self.client()

    def scan_nodes(self) -> list[str]:
        return [n.name for n in self.client().get_primaries() if not self._nodes.is_down(n.name)]

    def scan(self, node: str, cursor: int, match: bytes, count: int) -> tuple[int, list[bytes]]:
        cluster = self.client()
        target = cluster.get_node(node_name=node)
        if target is None:
            raise valkey.ConnectionError(f"node {node} is no longer in the cluster")
        cursors, keys = cluster.scan(cursor, match=match, count=count, target_nodes=target)
        return cursors[node], keys

    def memory(self) -> tuple[int, int]:
        """Summed over the primaries that answer with figures; raises if none does. A node
        that answers with anything else (an error, garbage, figures out of range) is up,
        and left out of the sums (:meth:`_left_out`): one broken node does not cost the
        metrics every other node's figures."""
        cluster = self.client()
        used = limit = reported = 0
        error: Exception = NodeDown("every node of the cluster is down")
        for node in cluster.get_primaries():
            permit = self._nodes.allow(node.name)
            if permit is Permit.REFUSED:
                continue
            try:
                node_used, node_limit = _memory_figures(cluster.info("memory", target_nodes=node))
            except NO_ANSWER as e:
                self._nodes.record(node.name, permit, e)
                error = e
                continue
            except Exception as e:  # noqa: BLE001 - whatever the node sent, it is not figures
                self._nodes.record(node.name, permit, None)
                self._left_out(node.name, e)
                error = e
                continue
            self._nodes.record(node.name, permit, None)
            reported += 1
            used += node_used
            limit += node_limit
        if not reported:
            raise error
        return used, limit

    def _left_out(self, node: str, error: Exception) -> None:
        """Count a node's figures left out of :meth:`memory`; a WARNING names the node and
        the count since the last one, at most every :data:`LEFT_OUT_WARNING_S` (a stats
        refresh runs every minute, and would repeat it on every one)."""
        now = time.monotonic()
        with self._lock:
            self._figures_left_out += 1
            if now - self._left_out_warned_at < LEFT_OUT_WARNING_S:
                return
            count, self._figures_left_out, self._left_out_warned_at = self._figures_left_out, 0, now
        logger.warning(
            "remote tier: cluster node %s answered INFO memory with no figures (%s: %.100r); "
            "its memory is left out of the tier's figures (%d times since the last warning)",
            node, type(error).__name__, str(error), count,
        )

    def _forget(self) -> None:
        """Drop the client, keeping its nodes to start the next one from."""
        with self._lock:
            old, self._cluster = self._cluster, None
            if old is not None:
                self._known = [(n.host, n.port) for n in old.get_nodes()] or self._known
        if old is not None:
            old.disconnect_connection_pools()
            old.close()

    def close(self) -> None:
        self._forget()


def remote_client(url: str, deadline: CallDeadline, *, timeout_s: float,
                  max_connections: int, cooldown_s: float) -> RemoteClient:
    """The client for a checked URL (:func:`storage.remote_url.parse_remote_url`); on a cluster, a node that
    does not answer is down for ``cooldown_s``."""
    if is_cluster_url(url):
        return ClusterClient(url, deadline, timeout_s=timeout_s,
                             max_connections=max_connections, cooldown_s=cooldown_s)
    return ServerClient(url, deadline, timeout_s=timeout_s, max_connections=max_connections)
