"""A pipelined batch on one Valkey/Redis server, on a connection that goes back to its pool
only in step with the server::

    commands ─▶ a pooled connection (or one opened for the batch: ``fresh``) ─▶ write all
             ─▶ read the replies in order ─▶ every one read: the connection back to the pool
                                          └─▶ anything else: the connection closed

A connection is in step when every reply the server sent for the commands written on it
has been read, and nothing more: the next command's reply is then the next to arrive. A
connection pooled out of step hands its next user the replies of someone else's commands,
each shifted by one. valkey's own pipeline closes its connection on a connection error or
a reply the parser refuses, but pools it after any other error, with replies still to
come; here a connection that was not read to the end is closed, whatever ended the read.

The client cannot tell a reply the server sent too many (a broken server, or a proxy that
delivers the reply of a command its client gave up on) from the next command's own: the
pool closes a connection that has bytes waiting when it is taken, but a stray reply may
arrive later. The records it shifts fail their checks; the remote store reads those again
``fresh``, on a connection opened for the batch and closed after it, which no reply of
another call can reach (``storage.remote_store.RemoteStore.get_many``).

A read past the call's bytes (:class:`storage.call_deadline.CallBytesSpent`) ends the batch
where it is: the replies read in full are kept, each of the others is that error.
"""
from __future__ import annotations

import valkey
from valkey.exceptions import ResponseError

from storage.call_deadline import CallBytesSpent

Command = tuple[tuple, dict]  # as valkey's pipeline queues it: the arguments, the options


def send(client: valkey.Valkey, commands: list[Command], *, fresh: bool = False) -> list:
    """The replies of ``commands`` (queued on ``client.pipeline()``), in order: a reply is
    the exception where the server refused its command or the call's bytes ran out. Raises
    where the server did not answer, or not in the protocol."""
    if not commands:
        return []
    pool = client.connection_pool
    if fresh:
        connection = pool.connection_class(**pool.connection_kwargs)
    else:
        connection = pool.get_connection(commands[0][0][0])
    in_step = False
    try:
        replies, in_step = _exchange(client, connection, commands)
    finally:
        if fresh or not in_step:
            connection.disconnect()
        if not fresh:
            pool.release(connection)
    return replies


def _exchange(client: valkey.Valkey, connection: valkey.Connection,
              commands: list[Command]) -> tuple[list, bool]:
    """Write every command, then read their replies in order; the replies, and whether
    every one was read."""
    connection.send_packed_command(connection.pack_commands([args for args, _ in commands]))
    replies: list = []  # an error is kept without its frames, which would hold the replies
    for args, options in commands:
        try:
            replies.append(client.parse_response(connection, args[0], **options))
        except ResponseError as e:  # the server refused the command: its reply, read in full
            replies.append(e.with_traceback(None))
        except CallBytesSpent as e:
            replies += [e.with_traceback(None)] * (len(commands) - len(replies))
            return replies, False
    return replies, True
