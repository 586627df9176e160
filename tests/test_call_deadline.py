"""A call's deadline cuts every socket wait of the thread making it, and only of that thread."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import valkey
from valkey._parsers import _LibvalkeyParser, _RESP2Parser, _RESP3Parser
from valkey.exceptions import InvalidResponse

from storage import call_deadline
from storage.call_deadline import (
    MAX_BULK_BYTES, MIN_RATE_BYTES_S, CallBytesSpent, CallDeadline, _DeadlineSocket,
    connection_class,
)


class _Clock:
    """``time.monotonic`` for storage.call_deadline, moved by the test: the time left, and
    a transfer's rate, are then exact, whatever else the machine runs."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_waits_are_cut_to_the_time_left(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(call_deadline, "time", clock)
    deadline = CallDeadline()
    assert deadline.wait_s(5.0) == 5.0 and deadline.wait_s(None) is None  # no call under way
    deadline.at = clock.now + 1.0
    clock.now += 0.25
    assert deadline.wait_s(5.0) == deadline.wait_s(None) == 0.75
    assert deadline.wait_s(0.1) == 0.1
    assert deadline.wait_s(0) == 0  # a poll stays a poll
    clock.now += 0.75
    with pytest.raises(socket.timeout, match="deadline"):
        deadline.wait_s(5.0)


def test_the_deadline_belongs_to_the_thread_making_the_call():
    deadline = CallDeadline()
    deadline.at = time.monotonic() - 1
    seen = []
    thread = threading.Thread(target=lambda: seen.append(deadline.wait_s(5.0)))
    thread.start()
    thread.join()
    assert seen == [5.0]


def test_reads_that_each_get_a_byte_in_time_still_end_at_the_deadline(monkeypatch):
    """A byte every 0.02 s, each well within the socket's 1 s timeout: the call still ends
    at its 0.31 s deadline, after the 16 bytes read at 0, 0.02, ..., 0.30 s."""
    clock = _Clock()
    monkeypatch.setattr(call_deadline, "time", clock)
    ours, peer = socket.socketpair()
    deadline = CallDeadline()
    ours.settimeout(1.0)
    sock = _DeadlineSocket(ours, deadline)
    peer.sendall(b"x" * 100)
    received = 0
    try:
        deadline.at = clock.now + 0.31
        with pytest.raises(socket.timeout):
            while True:
                received += len(sock.recv(1))
                clock.now += 0.02
        assert received == 16
        assert sock.gettimeout() == 1.0  # the client's own timeout is kept
    finally:
        ours.close()
        peer.close()


def _read_at_rate(monkeypatch, rate_bytes_s: float, total: int) -> int:
    """Read ``total`` bytes through a call with 0.05 s left, the clock moving as if they
    arrived at ``rate_bytes_s``; the bytes read before the deadline cut the call."""
    clock = _Clock()
    monkeypatch.setattr(call_deadline, "time", clock)
    ours, peer = socket.socketpair()
    ours.settimeout(5.0)
    deadline = CallDeadline()
    sock = _DeadlineSocket(ours, deadline)

    def send() -> None:
        try:
            peer.sendall(b"x" * total)
        except OSError:  # the reader gave up and closed its end
            pass

    sender = threading.Thread(target=send)
    sender.start()
    received = 0
    try:
        deadline.at = clock.now + 0.05
        while received < total:
            try:
                n = len(sock.recv(256 << 10))
            except socket.timeout:
                break
            received += n
            clock.now += n / rate_bytes_s
    finally:
        ours.close()
        peer.close()
        sender.join()
    return received


def test_a_large_reply_at_a_working_rate_is_not_cut_off(monkeypatch):
    """8 MiB at 80 MiB/s takes 0.1 s, longer than the call's 0.05 s: the bytes earn it time."""
    assert _read_at_rate(monkeypatch, 80 << 20, 8 << 20) == 8 << 20


def test_a_large_reply_below_the_minimum_rate_is_cut_off(monkeypatch):
    """At 32 MiB/s a call gains half a second per second: 8 MiB (0.25 s) overruns 0.05 s."""
    received = _read_at_rate(monkeypatch, 32 << 20, 8 << 20)
    assert 0 < received < 8 << 20
    # cut when the clock, at 32 MiB/s, passed 0.05 s plus what the bytes earned at 64 MiB/s
    assert received / (32 << 20) >= 0.05 + received / MIN_RATE_BYTES_S - (256 << 10) / (32 << 20)


def test_a_call_reads_at_most_its_bytes(monkeypatch):
    """A call reads MAX_CALL_BYTES at most: a read is cut to what is left, and a read past
    them raises before it takes a byte. Outside a call, reads are not counted."""
    monkeypatch.setattr(call_deadline, "MAX_CALL_BYTES", 10)
    deadline = CallDeadline()
    ours, peer = socket.socketpair()
    sock = _DeadlineSocket(ours, deadline)
    try:
        peer.sendall(b"x" * 16)
        assert sock.recv(64) == b"x" * 16
        deadline.begin(5.0)
        peer.sendall(b"y" * 16)
        assert sock.recv(4) == b"y" * 4
        buf = bytearray(64)
        assert sock.recv_into(buf) == 6 and buf[:6] == b"y" * 6
        with pytest.raises(CallBytesSpent):
            sock.recv(64)
        deadline.end()
        assert sock.recv(64) == b"y" * 6  # still there, for whoever reads next
    finally:
        ours.close()
        peer.close()


def test_the_bytes_moved_extend_the_deadline_by_their_share():
    deadline = CallDeadline()
    deadline.moved(1 << 30)  # no call under way: nothing to move
    assert deadline.at is None
    deadline.at = 100.0
    deadline.moved(MIN_RATE_BYTES_S)
    assert deadline.at == 101.0


def test_tls_urls_get_tls_connections():
    assert issubclass(connection_class("rediss://h:1/0"), valkey.SSLConnection)
    assert issubclass(connection_class("valkeys://h:1/0"), valkey.SSLConnection)
    assert not issubclass(connection_class("redis://h:1/0"), valkey.SSLConnection)
    assert issubclass(connection_class("valkey://h:1/0"), valkey.Connection)


@pytest.mark.parametrize("parser", [_RESP2Parser, _RESP3Parser, _LibvalkeyParser])
def test_every_connection_reads_through_the_bounded_buffer(parser):
    """Whichever parser the library would pick (the C one where ``libvalkey`` is installed),
    a connection parses in Python through a buffer that refuses a reply declaring more than
    MAX_BULK_BYTES."""
    connection = connection_class("redis://h:1/0")(
        call_deadline=CallDeadline(), parser_class=parser)
    assert isinstance(connection._parser, _RESP3Parser if parser is _RESP3Parser else _RESP2Parser)
    left, right = socket.socketpair()
    try:
        connection._sock = left
        connection._parser.on_connect(connection)
        right.sendall(b"$%d\r\nabc" % (MAX_BULK_BYTES + 1))
        with pytest.raises(InvalidResponse, match="bulk reply"):
            connection._parser.read_response()
    finally:
        left.close()
        right.close()
