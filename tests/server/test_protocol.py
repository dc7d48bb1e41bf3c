"""The wire protocol with raw sockets (no client library): malformed requests from Redis's
protocol tests, inline commands, pipelining, slow readers, maxclients and idle timeouts.

A malformed request must answer `-ERR Protocol error: ...` and close the connection, while the
server keeps serving everyone else. Tests that expect a close send exactly the bytes that
prove the request bad: were more to remain unread when the server closes, the kernel would
reset the connection and could drop the error reply before the test reads it.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from support import (
    Error,
    RespReader,
    connect_admitted,
    encode_command,
    recv_all_until_close,
    recv_until,
)

INLINE_BYTES_MAX = 64 * 1024


@pytest.fixture(autouse=True)
def server_still_serves(request):
    """After every test of this module, a fresh connection still gets PONG."""
    yield
    if "server" in request.fixturenames:
        server = request.getfixturevalue("server")
        with server.connect(timeout=5) as sock:
            sock.sendall(b"PING\r\n")
            assert recv_until(sock) == b"+PONG\r\n", "the server stopped serving new connections"


def exchange_until_close(server, data: bytes, timeout: float = 10.0) -> bytes:
    """Sends `data` on a new connection and returns everything read until the server closes."""
    with server.connect() as sock:
        sock.sendall(data)
        return recv_all_until_close(sock, timeout)


def exchange(server, data: bytes, replies: int) -> list:
    """Sends `data` on a new connection and reads `replies` replies; the connection stays open."""
    with server.connect() as sock:
        sock.sendall(data)
        reader = RespReader(sock)
        return [reader.read() for _ in range(replies)]


# -- malformed requests (after Redis's tests/unit/protocol.tcl) --------------------------------


def test_negative_multibulk_length_is_ignored(server):
    with server.connect() as sock:
        sock.sendall(b"*-10\r\n")
        sock.sendall(b"PING\r\n")
        assert recv_until(sock) == b"+PONG\r\n"
        sock.sendall(b"*0\r\n*-1\r\n*1\r\n$4\r\nPING\r\n")
        assert recv_until(sock) == b"+PONG\r\n"


@pytest.mark.parametrize(
    "request_bytes,error",
    [
        (b"*3000000000\r\n", b"invalid multibulk length"),
        (b"*20000000\r\n", b"invalid multibulk length"),
        (b"*blabla\r\n", b"invalid multibulk length"),
        (b"*3\r\n$3\r\nSET\r\n$1\r\nx\r\nfooz\r\n", b"expected '$', got 'f'"),
        (b"*1\r\nfoo\r\n", b"expected '$', got 'f'"),
        (b"*3\r\n$3\r\nSET\r\n$1\r\nx\r\n$-10\r\n", b"invalid bulk length"),
        (b"*3\r\n$3\r\nSET\r\n$1\r\nx\r\n$-1\r\n", b"invalid bulk length"),
        (b"*3\r\n$3\r\nSET\r\n$1\r\nx\r\n$2000000000\r\n", b"invalid bulk length"),
        (b"*3\r\n$3\r\nSET\r\n$1\r\nx\r\n$blabla\r\n", b"invalid bulk length"),
        (b"*1\r\n$4\r\nPINGxx", b"bulk data not followed by CRLF"),
        (b'set """test-key""" test-value\r\nping\r\n', b"unbalanced quotes in request"),
        (b'set "unterminated\r\n', b"unbalanced quotes in request"),
        (b"get 'it\r\n", b"unbalanced quotes in request"),
    ],
    ids=lambda value: value[:40].decode("latin-1") if isinstance(value, bytes) else str(value),
)
def test_malformed_request_answers_a_protocol_error_and_closes(server, request_bytes, error):
    data = exchange_until_close(server, request_bytes)
    assert data == b"-ERR Protocol error: " + error + b"\r\n"


def test_protocol_error_after_good_requests_answers_them_first(server):
    data = exchange_until_close(
        server, b"PING\r\n" + encode_command("SET", "proto:k", "v") + b"*3000000000\r\n"
    )
    assert data == b"+PONG\r\n+OK\r\n-ERR Protocol error: invalid multibulk length\r\n"
    assert exchange(server, encode_command("GET", "proto:k"), 1) == [b"v"]


def test_generic_wrong_number_of_args_keeps_the_connection(server):
    with server.connect() as sock:
        sock.sendall(b"ping x y z\r\n")
        assert recv_until(sock) == b"-ERR wrong number of arguments for 'ping' command\r\n"
        sock.sendall(b"ping\r\n")
        assert recv_until(sock) == b"+PONG\r\n"


def test_too_big_inline_request(server):
    # A line "of 1 GiB" without CRLF: refused once it passes 64 KiB, without reading the rest.
    data = exchange_until_close(server, b"a" * (70 * 1024))
    assert data == b"-ERR Protocol error: too big inline request\r\n"


def test_too_big_count_lines(server):
    data = exchange_until_close(server, b"*" + b"1" * (INLINE_BYTES_MAX + 10))
    assert data == b"-ERR Protocol error: too big mbulk count string\r\n"
    data = exchange_until_close(server, b"*1\r\n$" + b"1" * (INLINE_BYTES_MAX + 10))
    assert data == b"-ERR Protocol error: too big bulk count string\r\n"


def test_an_inline_request_just_under_the_limit_is_served(server):
    line = b"ECHO " + b"x" * (INLINE_BYTES_MAX - 100) + b"\r\n"
    assert exchange(server, line, 1) == [b"x" * (INLINE_BYTES_MAX - 100)]


@pytest.mark.parametrize("prefix", [b"\x00", b"*\x00", b"$\x00"], ids=["nul", "star-nul", "dollar-nul"])
def test_protocol_desync(server, prefix):
    """Redis's 'Protocol desync regression test': a NUL, then lines of 'A'. Redis never finds
    the end of such a request (it looks for the line end with strchr, which stops at the NUL),
    so once 64 KiB have come it answers a protocol error and closes. It must never run the
    lines as commands. copse may refuse the NUL at once; then the test sends nothing more."""
    line = b"A" * 1024 + b"\n"
    payload = (prefix + line * 70)[: INLINE_BYTES_MAX + 1]
    first = len(prefix) + len(line)
    data, closed = b"", False
    with server.connect() as sock:
        sock.sendall(payload[:first])
        data, closed = _read_for(sock, 1.0)
        if not closed:
            sock.sendall(payload[first:])
            more, closed = _read_for(sock, 3.0)
            data += more
    assert b"unknown command" not in data, (
        f"the server ran the bytes after {prefix!r} as commands: {data[:160]!r}..."
    )
    assert closed, f"after {prefix!r} and 64 KiB of lines the connection is still open: {data[:160]!r}"
    assert data.startswith(b"-ERR Protocol error: ") and data.count(b"\r\n") == 1, data[:160]


def _read_for(sock: socket.socket, seconds: float) -> tuple[bytes, bool]:
    """Reads for up to `seconds`: (what came, whether the server closed the connection)."""
    data = b""
    deadline = time.monotonic() + seconds
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return data, False
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk


def test_binary_garbage_as_an_inline_request(server):
    rng = random.Random(1)
    allowed = [b for b in range(256) if b not in (ord("\n"), ord("*"), 0)]
    garbage = bytes(rng.choice(allowed) for _ in range(70 * 1024))
    data = exchange_until_close(server, garbage)
    assert data == b"-ERR Protocol error: too big inline request\r\n"


def test_a_nul_in_an_inline_request_is_a_protocol_error(server):
    """Redis cannot complete such a line (see test_protocol_desync); copse refuses it at once."""
    data = exchange_until_close(server, b"GET a\x00b c\n")
    assert data.startswith(b"-ERR Protocol error: "), data


def test_binary_garbage_as_a_multibulk_request(server):
    data = exchange_until_close(server, b"*\xff\xfe\x00\x01\r\n")
    assert data == b"-ERR Protocol error: invalid multibulk length\r\n"
    data = exchange_until_close(server, b"*2\r\n$1\r\nx\r\n\x80\x81")
    # copse shows a byte above 0x7f as the Latin-1 character of that value, in UTF-8.
    assert data == b"-ERR Protocol error: expected '$', got '\xc2\x80'\r\n"


def test_random_garbage_never_breaks_the_server(server):
    """Short random byte strings, each on its own connection, then end of input: every reply is
    well-formed RESP and a protocol error, if any, is the last thing sent."""
    rng = random.Random(20241122)
    alphabet = b"*$\r\n:+-0123456789 \"'\\xABCDEFGHIJKLMNOPQRSTUVWXYZ\x00\xff"
    for round_number in range(150):
        length = rng.randint(1, 60)
        if round_number % 2:
            garbage = bytes(rng.choice(alphabet) for _ in range(length))
        else:
            garbage = bytes(rng.randrange(256) for _ in range(length))
        # Nothing that could change the store or the server.
        if any(word in garbage.upper() for word in (b"FLUSH", b"CONFIG", b"QUIT", b"DEL", b"SET")):
            continue
        with server.connect() as sock:
            sock.sendall(garbage)
            sock.shutdown(socket.SHUT_WR)
            data = recv_all_until_close(sock, timeout=10)
        reader = RespReader(_BytesSocket(data))
        replies = []
        while reader.buf or not reader.closed:
            try:
                replies.append(reader.read())
            except ConnectionError:
                break
        for reply in replies[:-1]:
            assert not (isinstance(reply, Error) and reply.startswith(b"ERR Protocol error")), (
                f"replies after a protocol error for {garbage!r}: {data!r}"
            )


class _BytesSocket:
    """A socket stand-in that yields `data`, then end of stream (for RespReader)."""

    def __init__(self, data: bytes):
        self.data = data

    def recv(self, _size: int) -> bytes:
        data, self.data = self.data, b""
        return data


# -- inline commands and pipelining ------------------------------------------------------------


def test_inline_commands(server):
    with server.connect() as sock:
        reader = RespReader(sock)
        sock.sendall(b"PING\r\n")
        assert reader.read() == b"PONG"
        sock.sendall(b'SET inline:k "a b"\r\n')
        assert reader.read() == b"OK"
        sock.sendall(b"GET inline:k\r\n")
        assert reader.read() == b"a b"
        sock.sendall(b"SET inline:q 'it\\'s'\n")  # a bare LF ends a line too
        assert reader.read() == b"OK"
        sock.sendall(b"GET inline:q\r\n")
        assert reader.read() == b"it's"
        sock.sendall(b'SET inline:x "\\x41\\x42\\n\\t\\"end"\r\n')
        assert reader.read() == b"OK"
        sock.sendall(b"GET inline:x\r\n")
        assert reader.read() == b'AB\n\t"end'
        sock.sendall(b"\r\n\r\n   \r\nPING\r\n")  # empty lines are skipped, unanswered
        assert reader.read() == b"PONG"
        sock.sendall(b"  echo   spaced\t\targs  \r\n")
        assert reader.read() == Error(b"ERR wrong number of arguments for 'echo' command")


def test_pipelined_inline_and_mixed_requests(server):
    data = (
        b"PING\r\nSET pipe:k v1\r\nGET pipe:k\r\n"
        + encode_command("APPEND", "pipe:k", "2")
        + b"GET pipe:k\r\nINCR pipe:n\r\n"
        + encode_command("INCR", "pipe:n")
        + b"ECHO last\r\n"
    )
    assert exchange(server, data, 8) == [b"PONG", b"OK", b"v1", 3, b"v12", 1, 2, b"last"]


def test_a_request_split_into_single_bytes(server):
    data = encode_command("SET", "split:k", "value") + encode_command("GET", "split:k") + b"PING\r\n"
    with server.connect() as sock:
        for byte in data:
            sock.sendall(bytes([byte]))
            time.sleep(0.001)
        reader = RespReader(sock)
        assert [reader.read() for _ in range(3)] == [b"OK", b"value", b"PONG"]


def test_deep_raw_pipeline_replies_in_order(server):
    count = 20_000
    data = b"".join(
        encode_command("SET", f"deep:{i}", str(i)) + encode_command("GET", f"deep:{i}")
        for i in range(count // 2)
    )
    with server.connect() as sock:
        sender = threading.Thread(target=sock.sendall, args=(data,))
        sender.start()
        reader = RespReader(sock)
        replies = [reader.read() for _ in range(count)]
        sender.join()
    assert replies == [reply for i in range(count // 2) for reply in (b"OK", str(i).encode())]


# -- slow readers, connection limits, idle timeouts --------------------------------------------


BIG_VALUE_BYTES = 64 * 1024
# The slow reader's GETs: values and a count large enough that holding the replies of one
# wave (up to 1,024 commands) would cost GiBs, many times the bound asserted below; replies
# the server may hold for one client are bounded by client_pending_reply_bytes_max (64 MiB).
SLOW_VALUE_BYTES = 2 * 1024 * 1024
SLOW_GETS = 1_500
SLOW_READER_PEAK_GROWTH_MAX = 256 * 1024 * 1024


def test_a_slow_reader_neither_blocks_others_nor_grows_memory(make_server):
    """At 101534c a wave's replies were all held: 1,024 GETs of a 2 MiB value from a client
    that never reads cost 2 GiB. Now the connection stops dispatching at its reply budget."""
    server = make_server()
    value = bytes(range(256)) * (SLOW_VALUE_BYTES // 256)
    with server.connect() as setup:
        setup.sendall(encode_command("SET", "bigkey", value))
        assert recv_until(setup) == b"+OK\r\n"
    peak_before = server.peak_rss_bytes()

    slow = server.connect(timeout=60)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    requests = encode_command("GET", "bigkey") * SLOW_GETS
    send_error = []

    def send_all():
        try:
            slow.sendall(requests)
        except OSError as err:
            send_error.append(err)

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    # Not reading: the server has 3 GB of replies to give this client.
    latencies = []
    with server.connect(timeout=5) as other:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            started = time.monotonic()
            other.sendall(b"PING\r\n")
            assert recv_until(other) == b"+PONG\r\n"
            latencies.append(time.monotonic() - started)
            time.sleep(0.1)
    assert max(latencies) < 1.0, f"PING took {max(latencies):.3f} s while a client was not reading"
    growth = server.peak_rss_bytes() - peak_before
    assert growth < SLOW_READER_PEAK_GROWTH_MAX, (
        f"server peak RSS grew by {growth / 2**20:.0f} MiB for one client that does not read"
    )

    # Now read everything: every reply intact, in order.
    unit = b"$%d\r\n" % SLOW_VALUE_BYTES + value + b"\r\n"
    pattern = unit * 4  # any 4 MiB read fits in it from any offset within a unit
    total = len(unit) * SLOW_GETS
    buffer = bytearray(4 * 1024 * 1024)
    view = memoryview(buffer)
    received = 0
    slow.settimeout(60)
    while received < total:
        n = slow.recv_into(buffer)
        assert n > 0, f"the server closed the slow client after {received // len(unit)} replies"
        offset = received % len(unit)
        assert view[:n] == pattern[offset : offset + n], (
            f"reply bytes differ near byte {received} (reply {received // len(unit)})"
        )
        received += n
    sender.join(timeout=10)
    assert not send_error, send_error
    slow.settimeout(0.5)
    try:
        extra = slow.recv(100)
    except socket.timeout:
        extra = b""
    assert extra == b"", f"more than {SLOW_GETS} replies: {extra[:50]!r}"
    slow.close()
    growth = server.peak_rss_bytes() - peak_before
    assert growth < SLOW_READER_PEAK_GROWTH_MAX, f"peak RSS grew by {growth / 2**20:.0f} MiB"
    assert server.client().info("stats")["copse_reply_backpressure_waits"] > 0


def test_sigterm_with_a_client_that_does_not_read(make_server):
    """Shutdown must not wait forever for a client that never reads its replies."""
    server = make_server()
    with server.connect() as setup:
        setup.sendall(encode_command("SET", "bigkey", b"x" * BIG_VALUE_BYTES))
        assert recv_until(setup) == b"+OK\r\n"
    stuck = server.connect()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    threading.Thread(
        target=lambda: _ignore_errors(stuck.sendall, encode_command("GET", "bigkey") * 2000),
        daemon=True,
    ).start()
    time.sleep(0.5)
    try:
        server.stop()  # fails unless the server exits 0 within 15 s of SIGTERM
    finally:
        stuck.close()


def _ignore_errors(function, *args):
    try:
        function(*args)
    except OSError:
        pass


def test_sigterm_answers_what_was_read_then_exits(make_server):
    server = make_server()
    with server.connect() as sock:
        reader = RespReader(sock)
        sock.sendall(encode_command("SET", "before:term", "v") + b"PING\r\n")
        assert [reader.read(), reader.read()] == [b"OK", b"PONG"]
        server.stop()
        assert reader.at_eof(timeout=5), "the connection is closed at shutdown"
    server.restart()
    with server.connect() as sock:
        sock.sendall(encode_command("GET", "before:term"))
        assert RespReader(sock).read() == b"v"


def test_maxclients(make_server):
    server = make_server("--maxclients", "2")
    first = connect_admitted(server)
    second = connect_admitted(server)
    try:
        with server.connect() as third:
            assert recv_all_until_close(third) == b"-ERR max number of clients reached\r\n"
        first.close()
        # Once a client has gone, another may come (the count drops as soon as the server
        # notices the close).
        deadline = time.monotonic() + 5
        while True:
            with server.connect() as fourth:
                fourth.sendall(b"PING\r\n")
                reply = recv_until(fourth)
            if reply == b"+PONG\r\n":
                break
            assert reply == b"-ERR max number of clients reached\r\n", reply
            assert time.monotonic() < deadline, "a closed client still counts against maxclients"
            time.sleep(0.05)
        second.sendall(b"PING\r\n")
        assert recv_until(second) == b"+PONG\r\n", "existing clients keep working"
    finally:
        first.close()
        second.close()


def test_idle_timeout_closes_idle_clients_only(make_server):
    server = make_server("--timeout", "1")
    idle = server.connect()
    busy = server.connect()
    try:
        idle.sendall(b"PING\r\n")
        assert recv_until(idle) == b"+PONG\r\n"
        started = time.monotonic()
        closed_at = None
        idle.setblocking(False)
        while time.monotonic() - started < 3.5:
            busy.sendall(b"PING\r\n")
            assert recv_until(busy) == b"+PONG\r\n", "an active client was closed"
            if closed_at is None:
                try:
                    if idle.recv(100) == b"":
                        closed_at = time.monotonic() - started
                except BlockingIOError:
                    pass
            time.sleep(0.2)
        assert closed_at is not None, "an idle client was not closed within 3.5 s (--timeout 1)"
        assert 0.8 <= closed_at <= 3.0, f"idle client closed after {closed_at:.2f} s (--timeout 1)"
    finally:
        idle.close()
        busy.close()


def test_idle_timeout_zero_never_closes(server):
    with server.connect() as sock:
        time.sleep(1.5)
        sock.sendall(b"PING\r\n")
        assert recv_until(sock) == b"+PONG\r\n"


# -- protocol switches, pipelined auth, vanished clients, many clients ---------------------------


def test_each_reply_uses_the_protocol_in_force_when_its_command_ran(server):
    data = (
        encode_command("GET", "missing:proto")
        + encode_command("HELLO", "3")
        + encode_command("GET", "missing:proto")
        + encode_command("HELLO", "2")
        + encode_command("GET", "missing:proto")
    )
    with server.connect() as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        replies = recv_all_until_close(sock)
    # RESP2 null; HELLO 3's map (7 pairs); RESP3 null; HELLO 2's flat array; RESP2 null.
    assert replies.startswith(b"$-1\r\n%7\r\n"), replies[:40]
    assert b"\r\n_\r\n*14\r\n" in replies, replies
    assert replies.endswith(b"\r\n$-1\r\n"), replies[-40:]


def test_pipelined_auth_then_commands(make_server):
    server = make_server("--requirepass", "pw")
    with server.connect() as sock:
        sock.sendall(
            encode_command("GET", "k")
            + encode_command("AUTH", "pw")
            + encode_command("SET", "k", "v")
            + encode_command("GET", "k")
        )
        reader = RespReader(sock)
        assert [reader.read() for _ in range(4)] == [
            Error(b"NOAUTH Authentication required."), b"OK", b"OK", b"v"
        ]


def test_a_write_from_a_client_that_vanished_is_applied(server):
    sock = server.connect()
    sock.sendall(encode_command("SET", "vanished:k", "applied"))
    sock.close()
    deadline = time.monotonic() + 5
    while True:
        with server.connect() as check:
            check.sendall(encode_command("GET", "vanished:k"))
            value = RespReader(check).read()
        if value == b"applied" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert value == b"applied", "a command the server read was dropped when its client closed"


def test_many_concurrent_connections(server):
    connections = [server.connect() for _ in range(400)]
    try:
        for i, sock in enumerate(connections):
            sock.sendall(encode_command("SET", f"conn:{i}", str(i)))
        for sock in connections:
            assert recv_until(sock) == b"+OK\r\n"
        for i, sock in enumerate(connections):
            sock.sendall(encode_command("GET", f"conn:{(i + 1) % len(connections)}"))
        for i, sock in enumerate(connections):
            assert RespReader(sock).read() == str((i + 1) % len(connections)).encode()
    finally:
        for sock in connections:
            sock.close()
