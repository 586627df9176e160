"""A fake Valkey/Redis server for the hostile-server tests: an honest in-memory server on
loopback (``GET``, ``SET``, ``EXISTS``, ``DEL``, ``SCAN``, ``INFO``, ``CLUSTER SLOTS``, and
the client's connection handshake, in RESP2 or, after ``HELLO 3``, RESP3) whose replies
the test may take over.

``HostileServer.script``, when set, is given each batch of data commands (those that
arrived together: a pipeline) and returns what to send instead (a :class:`Reply`), or
``None`` to answer honestly. The handshake (``HELLO``, ``AUTH``, ``CLIENT``, ``SELECT``,
``PING``, ``READONLY``, ``ASKING``) is always answered honestly, so the client reaches the
commands under test. ``honest(command)`` is the reply the server would have sent, for a
script to build on.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import select
import socket
from collections.abc import Callable

from ports import LoopbackServer

Command = list[bytes]

HANDSHAKE = (b"HELLO", b"AUTH", b"CLIENT", b"SELECT", b"PING", b"READONLY", b"ASKING")
_SLOTS = 16384


@dataclasses.dataclass(frozen=True)
class Reply:
    """What a script sends for a batch: ``data``, ``times`` over (without a copy of it
    that long, which a test measuring the client's memory would count), one byte every
    ``drip_s`` seconds if set, then ``then``: ``"read"`` the next batch, ``"close"`` the
    connection, ``"hang"`` (keep it open, silent), or ``"flood"`` (``flood_bytes`` of junk
    as fast as the client reads them, then close)."""

    data: bytes = b""
    then: str = "read"
    drip_s: float = 0.0
    flood_bytes: int = 1 << 30
    times: int = 1


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def array(items: list[bytes]) -> bytes:
    """An array of already-encoded replies."""
    return b"*%d\r\n" % len(items) + b"".join(items)


class HostileServer(LoopbackServer):
    """See the module docstring. ``cluster``: answer ``CLUSTER SLOTS`` with every slot
    on this server, or as ``slot_owners`` says: ``(first slot, last slot, port)`` of each
    node of a cluster of several such servers on loopback, which the test gives each of them."""

    def __init__(self, *, cluster: bool = False) -> None:
        self.cluster = cluster
        self.slot_owners: list[tuple[int, int, int]] | None = None
        self.data: dict[bytes, bytes] = {}
        self.script: Callable[[list[Command]], Reply | None] | None = None
        self._conns: list[socket.socket] = []
        super().__init__()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/?cluster=1" if self.cluster else (
            f"redis://127.0.0.1:{self.port}/0"
        )

    def _stop_serving(self) -> None:
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ------------------------------------------------------------------ honest replies

    def honest(self, command: Command) -> bytes:
        name = command[0].upper()
        args = command[1:]
        if name == b"GET":
            value = self.data.get(args[0])
            return b"$-1\r\n" if value is None else bulk(value)
        if name == b"SET":
            self.data[args[0]] = args[1]
            return b"+OK\r\n"
        if name == b"EXISTS":
            return b":%d\r\n" % sum(k in self.data for k in args)
        if name == b"DEL":
            return b":%d\r\n" % sum(self.data.pop(k, None) is not None for k in args)
        if name == b"SCAN":
            pattern = args[args.index(b"MATCH") + 1] if b"MATCH" in args else b"*"
            keys = [k for k in list(self.data)
                    if fnmatch.fnmatchcase(k.decode("latin-1"), pattern.decode("latin-1"))]
            return array([bulk(b"0"), array([bulk(k) for k in keys])])
        if name == b"INFO":
            used = sum(len(k) + len(v) for k, v in list(self.data.items()))
            return bulk(b"# Memory\r\nused_memory:%d\r\nmaxmemory:0\r\n" % used)
        if name == b"CLUSTER" and args and args[0].upper() == b"SLOTS":
            owners = self.slot_owners or [(0, _SLOTS - 1, self.port)]
            return array([
                array([b":%d\r\n" % first, b":%d\r\n" % last,
                       array([bulk(b"127.0.0.1"), b":%d\r\n" % port, bulk(b"%040x" % port)])])
                for first, last, port in owners
            ])
        return b"-ERR unknown command '%s'\r\n" % name

    @staticmethod
    def _handshake(command: Command) -> bytes:
        name = command[0].upper()
        if name == b"HELLO":
            resp3 = command[1:2] == [b"3"]
            fields = [bulk(b"server"), bulk(b"valkey"), bulk(b"version"), bulk(b"8.0.0"),
                      bulk(b"proto"), b":%d\r\n" % (3 if resp3 else 2)]
            head = b"%%%d\r\n" % (len(fields) // 2) if resp3 else b"*%d\r\n" % len(fields)
            return head + b"".join(fields)
        if name == b"PING":
            return b"+PONG\r\n"
        return b"+OK\r\n"

    # ------------------------------------------------------------------ the connections

    def _accepted(self, conn: socket.socket) -> None:
        self._conns.append(conn)

    def _serve(self, conn: socket.socket) -> None:
        pending = bytearray()
        with conn:
            try:
                while not self._stopping.is_set():
                    batch = self._read_batch(conn, pending)
                    if batch is None:
                        return
                    data = [c for c in batch if c[0].upper() not in HANDSHAKE]
                    out = b"".join(self._handshake(c) for c in batch
                                   if c[0].upper() in HANDSHAKE)
                    reply = self.script(data) if (data and self.script is not None) else None
                    if reply is None:
                        conn.sendall(out + b"".join(self.honest(c) for c in data))
                        continue
                    conn.sendall(out)
                    if not self._send(conn, reply):
                        return
            except OSError:
                return

    def _send(self, conn: socket.socket, reply: Reply) -> bool:
        """Send a script's reply; whether to read on."""
        for _ in range(reply.times):
            if not reply.drip_s:
                conn.sendall(reply.data)
                continue
            for i in range(len(reply.data)):
                if self._stopping.wait(reply.drip_s):
                    return False
                conn.sendall(reply.data[i : i + 1])
        if reply.then == "hang":
            while not self._stopping.is_set():
                readable, _, _ = select.select([conn], [], [], 0.05)
                if readable and not conn.recv(1 << 16):
                    return False
        if reply.then == "flood":
            junk = b"x" * (1 << 20)
            for _ in range(reply.flood_bytes >> 20):
                if self._stopping.is_set():
                    break
                conn.sendall(junk)
        return reply.then == "read"

    def _read_batch(self, conn: socket.socket, pending: bytearray) -> list[Command] | None:
        """The commands that arrived together (a pipeline); ``None`` once the client hung up."""
        commands: list[Command] = []
        while True:
            batch, used = _parse_commands(bytes(pending))
            commands += batch
            del pending[:used]
            if commands and not pending and not select.select([conn], [], [], 0)[0]:
                return commands
            if self._stopping.is_set():
                return None
            if select.select([conn], [], [], 0.05)[0]:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    return None
                pending += chunk


def _parse_commands(buf: bytes) -> tuple[list[Command], int]:
    """The complete commands (arrays of bulk strings) at the start of ``buf``, and how many
    bytes they take."""
    commands: list[Command] = []
    pos = 0
    while True:
        end = buf.find(b"\r\n", pos)
        if end < 0 or buf[pos : pos + 1] != b"*":
            return commands, pos
        count, at, args = int(buf[pos + 1 : end]), end + 2, []
        for _ in range(count):
            line = buf.find(b"\r\n", at)
            if line < 0:
                return commands, pos
            length = int(buf[at + 1 : line])
            if len(buf) < line + 2 + length + 2:
                return commands, pos
            args.append(buf[line + 2 : line + 2 + length])
            at = line + 2 + length + 2
        commands.append(args)
        pos = at
