"""Valkey/Redis connections whose calls have a deadline for the whole call, and a bound on
the bytes they read.

The client's socket timeouts bound each wait, not a call: a server that drips a reply one
byte at a time never lets a single read time out. Here the thread making a call sets its
deadline (:class:`CallDeadline`), and every wait of a connection it uses (connecting,
sending, each read) is cut to the time left; past the deadline the next wait raises
``socket.timeout``, which the client turns into a ``TimeoutError`` after closing the
connection, so a connection is never returned to its pool in the middle of a reply::

    deadline.at = time.monotonic() + timeout_s
    try:
        client.get(...)            # connect ─ send ─ read … read  all before deadline.at
    finally:
        deadline.at = None

A call that moves many bytes earns time for them: every byte sent or received moves the
deadline by ``1 / MIN_RATE_BYTES_S`` seconds, so a batch of large blocks on a slow but working
link is not cut off, while a server that drips a byte at a time still meets the deadline
(a byte buys 15 ns).

A pooled connection has one user at a time, so the deadline is the calling thread's.
Not bounded by it: resolving the host name, and a TLS handshake (the socket timeout alone).

Nor is a reply's length, which only the server knows: a server that declares a terabyte
and sends it as fast as the link goes earns time faster than it spends it. So a bulk reply
may declare at most :data:`MAX_BULK_BYTES`; a longer (or negative) one is a protocol error
that closes the connection before a byte of it is read.

Nor, by itself, is the sum of a pipeline's replies: each of a call's ``n`` replies may be
that long, so the call would hold ``n`` of them. A call begun with :meth:`CallDeadline.begin`
reads at most :data:`MAX_CALL_BYTES` (the handshakes of the connections it opens included);
a read past them raises :class:`CallBytesSpent` before it takes a byte, and the client closes
that connection. The replies read in full before it stand; the caller may ask the others
again, in a call of their own (``RemoteStore.get_many`` does).
"""
from __future__ import annotations

import functools
import socket
import threading
import time
from urllib.parse import urlsplit

import valkey
from valkey._parsers.base import _RESPBase
from valkey._parsers.resp2 import _RESP2Parser
from valkey._parsers.socket import SocketBuffer
from valkey.exceptions import InvalidResponse


# The slowest transfer a call is allowed: a call may take its timeout plus one second per
# 64 MiB it moves.
MIN_RATE_BYTES_S = 64 << 20
# The longest bulk reply a connection reads: the largest record any tier holds (a block of
# the largest models at the largest block size is about half of it).
MAX_BULK_BYTES = 1 << 30
# The most one call reads: one longest bulk reply, with its framing and the handshake of a
# connection, so that a call always has room for a whole record. Not the batch's records
# summed: their sizes are known only once read, and ``n`` times the longest is what a
# hostile server would send. A batch of records larger together is read in several calls.
MAX_CALL_BYTES = MAX_BULK_BYTES + (64 << 10)


class CallBytesSpent(InvalidResponse):
    """The call has read :data:`MAX_CALL_BYTES`: the reply it was reading is cut off, and
    its connection closed (the client closes a connection on any error of a read)."""


class CallDeadline(threading.local):
    """The deadline of the remote call this thread is making (``at``; ``None``: none), and
    how many more bytes it may read (``unread``; ``None``: no bound)."""

    at: float | None = None
    unread: int | None = None

    def begin(self, timeout_s: float) -> None:
        """A call starts: it ends ``timeout_s`` from now and may read :data:`MAX_CALL_BYTES`."""
        self.at = time.monotonic() + timeout_s
        self.unread = MAX_CALL_BYTES

    def end(self) -> None:
        self.at = self.unread = None

    def moved(self, nbytes: int) -> None:
        """``nbytes`` went over the wire: the deadline moves by their share of time."""
        if self.at is not None and nbytes > 0:
            self.at += nbytes / MIN_RATE_BYTES_S

    def read_size(self, size: int) -> int:
        """How many bytes one read may take: ``size`` cut to what the call may still read.
        Raises :class:`CallBytesSpent` once that is nothing."""
        if self.unread is None:
            return size
        if self.unread <= 0:
            raise CallBytesSpent(f"the call has read its {MAX_CALL_BYTES} bytes")
        return min(size, self.unread)

    def received(self, nbytes: int) -> None:
        """``nbytes`` arrived: they move the deadline, and count against the call's bytes."""
        self.moved(nbytes)
        if self.unread is not None:
            self.unread -= nbytes

    def wait_s(self, timeout: float | None) -> float | None:
        """How long one socket operation may wait: ``timeout`` cut to the time left.
        Raises ``socket.timeout`` once the deadline has passed."""
        if self.at is None or timeout == 0:  # 0: a non-blocking poll
            return timeout
        left = self.at - time.monotonic()
        if left <= 0:
            raise socket.timeout("remote call deadline passed")
        return left if timeout is None else min(timeout, left)


class _DeadlineSocket:
    """A connected socket whose blocking operations end at the calling thread's deadline.
    The client sets its own timeouts on it; each wait is the smaller of that and the time left."""

    def __init__(self, sock: socket.socket, deadline: CallDeadline) -> None:
        self._sock = sock
        self._deadline = deadline
        self._timeout = sock.gettimeout()

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def recv(self, bufsize: int, *args):
        bufsize = self._deadline.read_size(bufsize)
        self._sock.settimeout(self._deadline.wait_s(self._timeout))
        data = self._sock.recv(bufsize, *args)
        self._deadline.received(len(data))
        return data

    def recv_into(self, buffer, nbytes: int = 0, *args):
        nbytes = self._deadline.read_size(nbytes or memoryview(buffer).nbytes)
        self._sock.settimeout(self._deadline.wait_s(self._timeout))
        count = self._sock.recv_into(buffer, nbytes, *args)
        self._deadline.received(count)
        return count

    def sendall(self, data) -> None:
        self._deadline.moved(memoryview(data).nbytes)  # known up front: one timeout for all
        self._sock.settimeout(self._deadline.wait_s(self._timeout))
        self._sock.sendall(data)

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class _BoundedBuffer(SocketBuffer):
    """The parser's buffer, refusing a bulk reply longer than :data:`MAX_BULK_BYTES` (the
    parser reads ``$-1``, nil, before asking it for a length)."""

    def read(self, length: int) -> bytes:
        if not 0 <= length <= MAX_BULK_BYTES:
            raise InvalidResponse(f"Protocol Error: a bulk reply of {length} bytes")
        return super().read(length)


@functools.cache
def _bounded(parser_class: type) -> type:
    """``parser_class`` reading through a :class:`_BoundedBuffer`. The parser in C (used when
    ``libvalkey`` is installed) has no Python buffer to bound: the Python one stands in for
    it (RESP2; the client switches it to RESP3 as it would without ``libvalkey``)."""
    if not issubclass(parser_class, _RESPBase):
        parser_class = _RESP2Parser

    class Bounded(parser_class):
        def on_connect(self, connection) -> None:
            super().on_connect(connection)
            self._buffer = _BoundedBuffer(self._sock, self.socket_read_size,
                                          connection.socket_timeout)

    return Bounded


class _Deadlined:
    """Makes a valkey connection class connect within, and talk through sockets bound by,
    the ``call_deadline`` of the thread using it (a pooled connection has one user at a time),
    and read bulk replies of at most :data:`MAX_BULK_BYTES`, and calls of at most
    :data:`MAX_CALL_BYTES`."""

    def __init__(self, *, call_deadline: CallDeadline, **kwargs) -> None:
        self._call_deadline = call_deadline
        super().__init__(**kwargs)
        self._connect_timeout = self.socket_connect_timeout

    def _connect(self):
        self.socket_connect_timeout = self._call_deadline.wait_s(self._connect_timeout)
        return _DeadlineSocket(super()._connect(), self._call_deadline)

    def set_parser(self, parser_class) -> None:  # also how the client switches to RESP3
        super().set_parser(_bounded(parser_class))


class DeadlineConnection(_Deadlined, valkey.Connection):
    pass


class DeadlineSSLConnection(_Deadlined, valkey.SSLConnection):
    pass


def connection_class(url: str) -> type[valkey.Connection]:
    """The connection class for a ``redis``/``valkey`` (TCP) or ``rediss``/``valkeys`` (TLS)
    URL; build the pool with ``call_deadline=`` a :class:`CallDeadline`."""
    if urlsplit(url).scheme in ("rediss", "valkeys"):
        return DeadlineSSLConnection
    return DeadlineConnection
