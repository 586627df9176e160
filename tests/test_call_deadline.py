"""A call's deadline cuts every socket wait of the thread making it, and only of that thread."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import valkey

from storage.call_deadline import MIN_RATE_BYTES_S, CallDeadline, _DeadlineSocket, connection_class


def test_waits_are_cut_to_the_time_left():
    deadline = CallDeadline()
    assert deadline.wait_s(5.0) == 5.0 and deadline.wait_s(None) is None  # no call under way
    deadline.at = time.monotonic() + 1.0
    assert 0.5 < deadline.wait_s(5.0) <= 1.0
    assert 0.5 < deadline.wait_s(None) <= 1.0
    assert deadline.wait_s(0.1) == 0.1
    assert deadline.wait_s(0) == 0  # a poll stays a poll
    deadline.at = time.monotonic() - 0.001
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


def test_reads_that_each_get_a_byte_in_time_still_end_at_the_deadline():
    ours, peer = socket.socketpair()
    deadline = CallDeadline()
    ours.settimeout(1.0)
    sock = _DeadlineSocket(ours, deadline)
    stop = threading.Event()

    def drip() -> None:
        while not stop.wait(0.02):
            peer.sendall(b"x")

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        deadline.at = time.monotonic() + 0.3
        start = time.monotonic()
        with pytest.raises(socket.timeout):
            while True:
                assert sock.recv(1)
        assert time.monotonic() - start < 0.6
        assert sock.gettimeout() == 1.0  # the client's own timeout is kept
    finally:
        stop.set()
        dripper.join()
        ours.close()
        peer.close()


def test_a_large_reply_at_a_working_rate_is_not_cut_off():
    """8 MiB at ~80 MiB/s takes ~0.1 s, longer than the call's 0.05 s: the bytes earn it time."""
    ours, peer = socket.socketpair()
    deadline = CallDeadline()
    ours.settimeout(1.0)
    sock = _DeadlineSocket(ours, deadline)
    total, chunk = 8 << 20, b"x" * (256 << 10)

    def send() -> None:
        try:
            for _ in range(total // len(chunk)):
                peer.sendall(chunk)
                time.sleep(len(chunk) / (80 << 20))
        except OSError:  # the reader gave up and closed its end
            pass

    sender = threading.Thread(target=send)
    sender.start()
    try:
        deadline.at = time.monotonic() + 0.05
        received = 0
        while received < total:
            received += len(sock.recv(1 << 20))
        assert received == total
        assert deadline.at > time.monotonic() - 1  # moved by the bytes: about 0.125 s
    finally:
        ours.close()
        peer.close()
        sender.join()


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
