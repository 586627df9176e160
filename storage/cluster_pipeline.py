"""A pipelined batch on a Valkey/Redis Cluster, sent node by node, where a node that does
not answer costs only its own commands::

    commands ─▶ by the node owning each key's slot ─▶ nodes that are down: not sent
             ─▶ write to every node, then read each node as its replies arrive
             ─▶ commands redirected (MOVED, ASK, TRYAGAIN): once more each, by the library

Every command names its one key first (``GET``, ``SET``, ``EXISTS``, ``DEL``). A node that
refuses the connection, resets it, has not replied by the call's deadline
(:mod:`storage.call_deadline`), or replies outside the protocol fails its own commands
from there on, each reply the exception; the other nodes' replies are kept. Replies are
read in the order they arrive, so a silent node does not hold up the others, and nothing
is sent twice. A node's connection goes back to its pool only once every reply was read
(valkey's own reader reads on past a reply that failed, and its pipeline pools a
connection whose replies are still to come); any other is closed, as in
:mod:`storage.server_pipeline`. Where the call reads its bytes
(:class:`storage.call_deadline.CallBytesSpent`), the replies not read are that error,
and the node is not down for it.

A node that failed is down (:class:`NodeBreakers`): it has a circuit breaker of its own,
with the store's cooldown, that opens at its first failure. One failure is enough: it is
the node's own (refused, reset, silent), not inferred from a whole call, and a frozen node
would cost the deadline of every call that asked it. While its breaker is open, the node's
commands fail without touching the network. After the cooldown, the next call asks it
again, as the probe, once the other nodes have answered (so a node still frozen costs
only its own keys); if it answers, it is up. A WARNING names the node (``host:port``) each
time its breaker opens: once per cooldown while it stays down. When a node goes down, the
next call first asks a node that is up for the slot map, so slots that moved (a replica
promoted in its place) are sent to their new owner.
"""
from __future__ import annotations

import logging
import select
import threading
from typing import NamedTuple

from valkey.cluster import ClusterNode, NodeCommands, PipelineCommand, ValkeyCluster
from valkey.exceptions import (
    AskError,
    ConnectionError,  # noqa: A004 - valkey's, which its client raises
    ResponseError,
    TimeoutError,  # noqa: A004
    TryAgainError,
    ValkeyError,
)

from storage.call_deadline import CallBytesSpent, CallDeadline
from storage.circuit_breaker import BreakerConfig, CircuitBreaker, Permit

logger = logging.getLogger(__name__)

NO_ANSWER = (ConnectionError, TimeoutError)  # the node did not answer (valkey's errors)
_REDIRECTED = (AskError, TryAgainError)  # MovedError is an AskError


class NodeDown(ConnectionError):
    """The reply of a command not sent because its node is down."""


class NodeBreakers:
    """A circuit breaker per cluster node, by name (``host:port``), opening at the node's
    first failure for ``cooldown_s``; see the module docstring. Thread-safe."""

    def __init__(self, cooldown_s: float) -> None:
        self._config = BreakerConfig(failures=1, cooldown_s=cooldown_s)
        self._lock = threading.Lock()
        self._breakers: dict[str, CircuitBreaker] = {}

    def _breaker(self, node: str) -> CircuitBreaker:
        with self._lock:
            breaker = self._breakers.get(node)
            if breaker is None:
                breaker = self._breakers[node] = CircuitBreaker(self._config)
            return breaker

    def allow(self, node: str) -> Permit:
        return self._breaker(node).allow()

    def record(self, node: str, permit: Permit, error: Exception | None) -> bool:
        """How the node did on a call ``permit`` let through (``error``: ``None`` if it
        answered); ``True`` if it went down (again)."""
        changed = self._breaker(node).record(permit, error is None)
        if changed and error is None:
            logger.info("remote tier: cluster node %s answers again", node)
        elif changed:
            logger.warning(
                "remote tier: cluster node %s does not answer (%s: %s); its keys are misses "
                "and drops for %.1f s", node, type(error).__name__, error, self._config.cooldown_s,
            )
        return changed and error is not None

    def is_down(self, node: str) -> bool:
        """Whether the node's breaker is open (a probe due or not)."""
        with self._lock:
            breaker = self._breakers.get(node)
        return breaker is not None and breaker.is_open


class Sent(NamedTuple):
    replies: list  # one per command, in order: the reply, or the exception where it failed
    answered: int  # how many nodes answered
    went_down: bool  # a node went down in this call: the slot map is worth asking again


def send(cluster: ValkeyCluster, commands: list[PipelineCommand], nodes: NodeBreakers,
         deadline: CallDeadline, *, fresh: bool = False) -> Sent:
    """Send ``commands`` (queued on ``cluster.pipeline()``) node by node; see the module
    docstring. ``fresh``: on connections opened for this call and closed after it, and
    without following a redirection (its reply stays the error)."""
    groups: dict[str, tuple[ClusterNode, list[PipelineCommand]]] = {}
    for c in commands:
        try:
            node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(c.args[1]))
        except ValkeyError as e:  # a slot no node covers
            c.result = e
            continue
        groups.setdefault(node.name, (node, []))[1].append(c)
    asked: dict[Permit, dict[str, tuple[ClusterNode, list[PipelineCommand]]]] = {
        Permit.CALL: {}, Permit.PROBE: {},
    }
    for name, (node, cmds) in groups.items():
        permit = nodes.allow(name)
        if permit is Permit.REFUSED:
            _fail(cmds, NodeDown(f"cluster node {name} is down"))
        else:
            asked[permit][name] = (node, cmds)
    errors: dict[str, Exception | None] = {
        name: NodeDown(f"cluster node {name}: call abandoned") for group in asked.values()
        for name in group
    }
    try:
        for group in asked.values():  # the nodes on probation last
            errors.update(_exchange(cluster, group, deadline, fresh))
    finally:  # every permit gets its outcome, or a node would stay on probation
        went_down = False
        for permit, group in asked.items():
            for name in group:
                went_down |= nodes.record(name, permit, errors[name])
    answered = sum(error is None for error in errors.values())
    for c in commands:
        if isinstance(c.result, _REDIRECTED) and not fresh:
            try:
                c.result = cluster.execute_command(*c.args, **c.options)
            except ValkeyError as e:
                c.result = e
    return Sent([c.result for c in commands], answered, went_down)


def _exchange(cluster: ValkeyCluster, group: dict[str, tuple[ClusterNode, list[PipelineCommand]]],
              deadline: CallDeadline, fresh: bool) -> dict[str, Exception | None]:
    """Write each node its commands, then read the nodes as their replies arrive, until the
    deadline; each node's error (``None``: it answered)."""
    sent: dict[str, NodeCommands] = {}
    in_step: set[str] = set()  # the nodes whose every reply was read
    try:
        for name, (node, cmds) in group.items():
            client = cluster.get_valkey_connection(node)
            pool = client.connection_pool
            try:
                if fresh:  # it connects as it writes
                    connection = pool.connection_class(**pool.connection_kwargs)
                else:
                    connection = pool.get_connection(cmds[0].args[0])
                sent[name] = NodeCommands(client.parse_response, pool, connection)
                for c in cmds:
                    sent[name].append(c)
                sent[name].write()  # on failure: every reply the error, the connection closed
            except (*NO_ANSWER, CallBytesSpent) as e:
                _fail(cmds, e)
        waiting = {n.connection._sock.fileno(): name for name, n in sent.items()
                   if n.connection._sock}
        while waiting:
            try:
                left = deadline.wait_s(None)
            except OSError:  # the deadline has passed
                break
            ready, _, _ = select.select(list(waiting), [], [], left)
            if not ready:
                break
            for fd in ready:
                name = waiting.pop(fd)
                if _read(sent[name]):
                    in_step.add(name)
        for name in waiting.values():
            _fail(sent[name].commands, TimeoutError("no reply by the call's deadline"))
    finally:
        for name, n in sent.items():
            if fresh or name not in in_step:  # replies may still come: never pooled
                n.connection.disconnect()
            if not fresh:
                n.connection_pool.release(n.connection)
    return {name: _failure(cmds) for name, (_, cmds) in group.items()}


def _read(node: NodeCommands) -> bool:
    """Read a node's replies in order; whether every one was read. A read that fails ends
    the node's call: the commands from there on fail with its error (read on, the next
    reply would be taken for theirs), and :func:`_exchange` closes the connection. An
    error is kept without its frames, which would hold the replies."""
    for i, c in enumerate(node.commands):
        try:
            c.result = node.parse_response(node.connection, c.args[0], **c.options)
        except ResponseError as e:  # the node refused the command (or redirects it)
            c.result = e.with_traceback(None)
        except Exception as e:  # noqa: BLE001 - whatever failed, the node's call ends here
            _fail(node.commands[i:], e.with_traceback(None))
            return False
    return True


def _failure(commands: list[PipelineCommand]) -> Exception | None:
    """What says the node failed the call: the first reply that is neither the node's own
    (a command it refused) nor cut off by the call's bytes (``None``: there is none)."""
    return next((c.result for c in commands if isinstance(c.result, Exception)
                 and not isinstance(c.result, (ResponseError, CallBytesSpent))), None)


def _fail(commands: list[PipelineCommand], error: Exception) -> None:
    for c in commands:
        c.result = error
