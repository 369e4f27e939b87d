"""Redis commands sent and received straight between a socket and block memory: a SET whose value
is sent from the tensor's own memory, and a GET received into the header buffer and the
destination, with the kernel waiting for whole values."""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections.abc import Iterator
from typing import Any, cast

import redis
import redis.cluster
import redis.exceptions

from worker.dataplane.tiers.remote.client import RedisClient


class ValueLength(Exception):
    """A GET reply whose length is not a block value's; the reply is left unread."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.length = length


@contextlib.contextmanager
def kernel_waits(sock: socket.socket) -> Iterator[bool]:
    """Let one recv/send call move a whole block while this thread does not hold the GIL.

    A socket with a timeout is non-blocking underneath, so a 32 MiB value comes in a few hundred
    recv calls (one per socket buffer, ~200 KiB on a unix socket), each of which takes the GIL
    back; with another Python thread busy (a movement's database work) each handover can wait
    a whole switch interval, so a big GET beside a busy thread takes many times as long as it
    does alone (benchmarks/README.md). Inside this block the socket is blocking, with the same
    timeout kept by the kernel (SO_RCVTIMEO / SO_SNDTIMEO), so a receive with MSG_WAITALL or a
    sendall waits for all of its bytes in one call, and a stalled server still times out.
    Yields False (nothing
    changed) for TLS sockets, which take no flags, and sockets without a timeout."""
    timeout = sock.gettimeout()
    if isinstance(sock, ssl.SSLSocket) or not timeout:
        yield False
        return
    limit = struct.pack("ll", int(timeout), int((timeout % 1) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    sock.settimeout(None)
    try:
        yield True
    finally:
        sock.settimeout(timeout)
        unset = struct.pack("ll", 0, 0)
        with contextlib.suppress(OSError):  # a socket the server closed meanwhile
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, unset)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, unset)


def set_without_join(client: RedisClient, name: bytes, header: bytes, data: memoryview) -> None:
    """SET name (header + data), sending `data` from its own memory."""
    target: redis.Redis | None
    if isinstance(client, redis.cluster.RedisCluster):
        node = client.get_node_from_key(name)
        target = node.redis_connection if node is not None else None
    else:
        target = client
    if target is None:
        client.set(name, header + bytes(data))
        return
    command = [
        b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (len(name), name, len(header) + len(data), header),
        data,
        b"\r\n",
    ]
    for attempt in range(2):
        pool = target.connection_pool
        connection = pool.get_connection()
        try:
            connection.connect()  # a no-op on a connected connection; the socket is needed below
            with kernel_waits(cast(socket.socket, connection._sock)):  # set by connect()
                connection.send_packed_command(command, check_health=False)
            connection.read_response()
            return
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            connection.disconnect()
            if attempt:
                raise  # a second failure on a fresh connection: the server is really gone
        except redis.exceptions.AskError:
            # The cluster moved the slot; the ordinary path follows the redirection.
            client.set(name, header + bytes(data))
            return
        finally:
            pool.release(connection)


def receive_value(client: redis.Redis, name: bytes, header: memoryview, data: memoryview) -> int | None:
    """GET `name` on a pooled connection, receiving a value of exactly header + data bytes
    into them; returns the value's length (another length is left unread, the connection
    dropped), None when the key does not exist. A broken connection is retried once."""
    pool = client.connection_pool
    for attempt in range(2):
        connection = pool.get_connection()
        try:
            connection.send_command("GET", name)
            return receive_bulk(connection, [header, data])
        except ValueLength as wrong:
            connection.disconnect()
            return wrong.length
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            connection.disconnect()
            if attempt:
                raise  # a second failure on a fresh connection: the server is really gone
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)
    raise AssertionError("unreachable")


def receive_bulk(connection: Any, parts: list[memoryview]) -> int | None:
    """Read one RESP bulk-string reply from the connection's socket into `parts`, in order."""
    sock = connection._sock
    if sock is None:
        raise redis.exceptions.ConnectionError("the connection closed before the reply")

    def recv_into(view: memoryview, flags: int = 0) -> int:
        try:
            n = sock.recv_into(view, 0, flags)
        except (TimeoutError, BlockingIOError) as exc:  # BlockingIOError: SO_RCVTIMEO ran out
            raise redis.exceptions.TimeoutError(f"Timeout reading from socket: {exc}") from exc
        except OSError as exc:
            raise redis.exceptions.ConnectionError(f"Error reading from socket: {exc}") from exc
        if n == 0:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return n

    head = bytearray(64)
    got = 0
    while (end := head.find(b"\r\n", 0, got)) < 0:
        if got == len(head):
            raise redis.exceptions.InvalidResponse(f"reply line too long: {bytes(head[:20])!r}")
        got += recv_into(memoryview(head)[got:])
    kind, line = head[:1], bytes(head[1:end])
    if kind == b"-":
        raise connection._parser.parse_error(line.decode(errors="replace"))
    if kind == b"_" or (kind == b"$" and line == b"-1"):
        return None
    if kind != b"$":
        raise redis.exceptions.InvalidResponse(f"unexpected reply {bytes(head[:got])!r} to GET")
    length = int(line)
    if length != sum(len(part) for part in parts):
        raise ValueLength(length)
    rest = memoryview(head)[end + 2 : got]
    tail = bytearray(2)
    # The reply's length is known now: each part can wait for all of its bytes at once.
    with kernel_waits(sock) as whole:
        flags = socket.MSG_WAITALL if whole else 0
        for part in [*parts, memoryview(tail)]:
            filled = min(len(rest), len(part))
            part[:filled] = rest[:filled]
            rest = rest[filled:]
            while filled < len(part):
                filled += recv_into(part[filled:], flags)
    if tail != b"\r\n":
        raise redis.exceptions.InvalidResponse("a bulk reply did not end with CRLF")
    return length
