"""What a client that cannot (yet) authenticate, or should not be served at all, can make the
server do (docs/security.md): the request limits before AUTH, protected mode, the AUTH
timeout, the file-descriptor limit and maxclients, and where the password comes from.

Memory bounds are measured as the server's peak resident memory (VmHWM) around the attack,
with requests large enough to pass the bound many times over were it not enforced.
"""

from __future__ import annotations

import socket
import time

import pytest

from support import Error, RespReader, encode_command, recv_all_until_close, recv_until

MIB = 1024 * 1024
VALUE_BYTES_MAX = 16 * MIB
# Redis since CVE-2021-32675 (config.rs: UNAUTHENTICATED_ARGS_MAX, UNAUTHENTICATED_BULK_BYTES_MAX).
UNAUTHENTICATED_ARGS_MAX = 10
UNAUTHENTICATED_BULK_BYTES_MAX = 16 * 1024
# What an unauthenticated attack may add to the server's peak memory: far below what the
# attacks below would cost without the limits (hundreds of MiB to GiBs).
ATTACK_PEAK_GROWTH_MAX = 64 * MIB


def send_until_closed(sock: socket.socket, arguments: int, bulk_bytes: int) -> tuple[int, int]:
    """Sends a well-formed DEL of `arguments - 1` bulks of `bulk_bytes`, stopping when the
    server closes; returns (bytes sent, bytes of the whole request)."""
    chunk = b"x" * MIB
    parts = [b"*%d\r\n$3\r\nDEL\r\n" % arguments]
    total = len(parts[0]) + (arguments - 1) * (len(b"$%d\r\n" % bulk_bytes) + bulk_bytes + 2)
    sent = 0
    try:
        sock.sendall(parts[0])
        sent += len(parts[0])
        for _ in range(arguments - 1):
            header = b"$%d\r\n" % bulk_bytes
            sock.sendall(header)
            sent += len(header)
            for _ in range(bulk_bytes // len(chunk)):
                sock.sendall(chunk)
                sent += len(chunk)
            sock.sendall(b"\r\n")
            sent += 2
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent, total


@pytest.mark.parametrize(
    "arguments, what",
    [
        # The review's request: a DEL of 47 bulks of 16 MiB (752 MiB), sent without AUTH.
        (48, "count"),
        # Few enough arguments, but each a 16 MiB bulk (144 MiB).
        (UNAUTHENTICATED_ARGS_MAX, "bulk"),
    ],
)
def test_an_unauthenticated_client_cannot_make_the_server_buffer_a_large_request(make_server, arguments, what):
    server = make_server("--requirepass", "pw")
    peak_before = server.peak_rss_bytes()
    with server.connect(timeout=30) as sock:
        sent, total = send_until_closed(sock, arguments, VALUE_BYTES_MAX)
    growth = server.peak_rss_bytes() - peak_before
    assert growth < ATTACK_PEAK_GROWTH_MAX, (
        f"an unauthenticated {arguments}-argument request ({what} limit) grew the server's peak "
        f"memory by {growth / MIB:.0f} MiB"
    )
    assert sent < total, "the server read the whole unauthenticated request instead of closing"
    # Others are served, and a client that authenticates may send the same request.
    client = server.client(password="pw")
    assert client.ping() is True
    client.close()


def test_unauthenticated_limits_answer_redis_errors_and_close(make_server):
    server = make_server("--requirepass", "pw")
    cases = [
        (b"*%d\r\n" % (UNAUTHENTICATED_ARGS_MAX + 1), b"-ERR Protocol error: unauthenticated multibulk length\r\n"),
        (b"*2\r\n$3\r\nDEL\r\n$%d\r\n" % (UNAUTHENTICATED_BULK_BYTES_MAX + 1),
         b"-ERR Protocol error: unauthenticated bulk length\r\n"),
    ]
    for request, error in cases:
        with server.connect() as sock:
            sock.sendall(request)
            assert recv_all_until_close(sock) == error
    # At the limits: answered NOAUTH, and the connection stays open.
    with server.connect() as sock:
        args = ["DEL"] + [b"k" * UNAUTHENTICATED_BULK_BYTES_MAX] * (UNAUTHENTICATED_ARGS_MAX - 1)
        sock.sendall(encode_command(*args) + b"PING\r\n")
        reader = RespReader(sock)
        assert reader.read() == Error(b"NOAUTH Authentication required.")
        assert reader.read() == Error(b"NOAUTH Authentication required.")


def test_pipelined_auth_lifts_the_limits_for_the_requests_after_it(make_server):
    server = make_server("--requirepass", "pw")
    value = b"v" * (4 * MIB)
    with server.connect(timeout=30) as sock:
        sock.sendall(encode_command("AUTH", "pw") + encode_command("SET", "big", value)
                     + encode_command("STRLEN", "big"))
        reader = RespReader(sock)
        assert [reader.read(), reader.read(), reader.read()] == [b"OK", b"OK", len(value)]
    # Without a password nobody is held to them.
    open_server = make_server()
    client = open_server.client()
    assert client.delete(*[f"k{i}" for i in range(100)]) == 0
    client.close()
