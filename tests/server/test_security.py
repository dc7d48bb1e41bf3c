"""What a client that cannot (yet) authenticate, or should not be served at all, can make the
server do (docs/security.md): the request limits before AUTH, protected mode, the AUTH
timeout, the file-descriptor limit and maxclients, and where the password comes from.

Memory bounds are measured as the server's peak resident memory (VmHWM) around the attack,
with requests large enough to pass the bound many times over were it not enforced.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from support import (
    Error,
    RespReader,
    encode_command,
    free_port,
    OutsideHost,
    recv_all_until_close,
    recv_until,
)

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


# -- protected mode ------------------------------------------------------------------------------

DENIED_PREFIX = (
    b"-DENIED Redis is running in protected mode because protected mode is enabled and no "
    b"password is set for the default user. In this mode connections are only accepted from "
    b"the loopback interface. "
)


@pytest.fixture
def outside():
    """A client host outside loopback, in a network namespace of the test's own (support.py)."""
    if os.geteuid() != 0:
        pytest.skip("creating a network namespace needs root")
    host = OutsideHost()
    yield host
    host.close()


def http_get_metrics_over(sock: socket.socket) -> bytes:
    with sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: copse\r\n\r\n")
        return recv_all_until_close(sock)


def http_get_metrics(address: str, port: int) -> bytes:
    return http_get_metrics_over(socket.create_connection((address, port), timeout=10))


def test_protected_mode_serves_loopback_when_bound_to_every_address(make_server):
    """Loopback clients are served by a server bound to 0.0.0.0 without a password (the
    decision over other peers is unit-tested in net/access.rs; below, from a host outside
    loopback in a network namespace of the test's own)."""
    metrics_port = free_port()
    server = make_server("--bind", "0.0.0.0", "--metrics-port", str(metrics_port))
    client = server.client()
    assert client.ping() is True
    assert client.config_get("protected-mode") == {"protected-mode": "yes"}
    assert http_get_metrics("127.0.0.1", metrics_port).startswith(b"HTTP/1.1 200 OK")
    assert "only loopback clients will be served" in server.log_text()
    client.close()


def test_protected_mode_refuses_peers_outside_loopback(make_server, outside):
    metrics_port = free_port()
    server = make_server("--bind", "0.0.0.0", "--metrics-port", str(metrics_port))
    with outside.connect(server.port) as sock:
        sock.sendall(b"PING\r\n")
        try:
            data = recv_all_until_close(sock)
        except ConnectionResetError:
            data = b""
        assert data.startswith(DENIED_PREFIX) and data.endswith(b"\r\n"), data[:300]
        assert data.count(b"\r\n") == 1
    assert http_get_metrics_over(outside.connect(metrics_port)).startswith(b"HTTP/1.1 403 Forbidden")
    # Loopback may turn it off; then everyone is served, metrics included.
    client = server.client()
    assert client.config_set("protected-mode", "no") is True
    with outside.connect(server.port) as sock:
        sock.sendall(b"PING\r\n")
        assert recv_until(sock) == b"+PONG\r\n"
    assert http_get_metrics_over(outside.connect(metrics_port)).startswith(b"HTTP/1.1 200 OK")
    with pytest.raises(Exception, match="must be 'yes' or 'no'"):
        client.config_set("protected-mode", "maybe")
    client.close()


def test_with_a_password_outside_peers_must_authenticate_and_metrics_stay_loopback(make_server, outside):
    metrics_port = free_port()
    server = make_server("--bind", "0.0.0.0", "--requirepass", "pw", "--metrics-port", str(metrics_port))
    with outside.connect(server.port) as sock:
        sock.sendall(b"PING\r\n" + encode_command("AUTH", "pw") + b"PING\r\n")
        reader = RespReader(sock)
        assert [reader.read(), reader.read(), reader.read()] == [
            Error(b"NOAUTH Authentication required."), b"OK", b"PONG"
        ]
    # The metrics page has no password: protected mode keeps it loopback-only.
    assert http_get_metrics_over(outside.connect(metrics_port)).startswith(b"HTTP/1.1 403 Forbidden")
    assert http_get_metrics("127.0.0.1", metrics_port).startswith(b"HTTP/1.1 200 OK")


def test_protected_mode_no_from_the_command_line(make_server, outside):
    server = make_server("--bind", "0.0.0.0", "--protected-mode", "no")
    client = server.client()
    assert client.config_get("protected-mode") == {"protected-mode": "no"}
    client.close()
    with outside.connect(server.port) as sock:
        sock.sendall(b"PING\r\n")
        assert recv_until(sock) == b"+PONG\r\n"


# -- descriptors, maxclients, the AUTH timeout -----------------------------------------------------


def test_maxclients_is_lowered_to_what_the_open_files_limit_leaves(make_server):
    """At 101534c, with 1,024 descriptors and maxclients 10,000, idle clients used up the
    descriptors and new clients timed out silently (accept failed). Now maxclients is lowered
    at start, and the client past it hears Redis's error and is closed."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    server = make_server(fd_limit=(1024, min(1024, hard)))
    admin = server.client()
    maxclients = int(admin.config_get("maxclients")["maxclients"])
    assert 0 < maxclients < 1024 - 32, maxclients
    assert f"maxclients has been reduced to {maxclients}" in server.log_text()
    with pytest.raises(Exception, match=f"try with {maxclients}"):
        admin.config_set("maxclients", "5000")
    # Fill every slot (the admin connection holds one), then one more.
    idle = []
    try:
        for _ in range(maxclients - 1):
            sock = server.connect()
            sock.sendall(b"PING\r\n")
            assert recv_until(sock) == b"+PONG\r\n"
            idle.append(sock)
        with server.connect() as extra:
            assert recv_all_until_close(extra, timeout=5) == b"-ERR max number of clients reached\r\n"
        assert admin.ping() is True, "the clients admitted keep being served"
    finally:
        for sock in idle:
            sock.close()
    admin.close()


def test_the_open_files_limit_is_raised_towards_the_hard_limit(make_server):
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    maxclients = min(10_000, hard - 1_000)
    server = make_server("--maxclients", str(maxclients), fd_limit=(256, hard))
    assert server.fd_soft_limit() > maxclients, "the soft limit stayed at 256"
    client = server.client()
    assert client.config_get("maxclients")["maxclients"] == str(maxclients)
    client.close()


def test_a_client_that_does_not_authenticate_is_closed_after_the_auth_timeout(make_server):
    server = make_server("--requirepass", "pw", "--auth-timeout", "1")
    silent = server.connect()
    chatty = server.connect()
    authenticated = server.client(password="pw")
    try:
        started = time.monotonic()
        closed = {}
        reader = RespReader(chatty)
        while time.monotonic() - started < 4 and len(closed) < 2:
            if "chatty" not in closed:
                try:
                    chatty.sendall(b"PING\r\n")
                    reply = reader.read()
                    if reply != Error(b"NOAUTH Authentication required."):
                        assert reply.startswith(b"ERR authentication timeout"), reply
                        assert reader.at_eof(), "the connection is closed after the error"
                        closed["chatty"] = time.monotonic() - started
                except (ConnectionError, OSError):
                    closed["chatty"] = time.monotonic() - started
            if "silent" not in closed:
                silent.setblocking(False)
                try:
                    data = silent.recv(1000)
                    assert data == b"" or data.startswith(b"-ERR authentication timeout"), data
                    closed["silent"] = time.monotonic() - started
                except BlockingIOError:
                    pass
            time.sleep(0.1)
        assert set(closed) == {"chatty", "silent"}, f"not closed within 4 s: {closed}"
        assert all(0.8 <= at <= 3.5 for at in closed.values()), closed
        assert authenticated.ping() is True, "an authenticated client is not timed out"
    finally:
        silent.close()
        chatty.close()
        authenticated.close()


# -- where the password comes from -----------------------------------------------------------------


def test_the_password_from_a_file(make_server, tmp_path):
    secret = tmp_path / "password"
    secret.write_text("from a file\n")
    server = make_server("--requirepass-file", str(secret))
    assert server.client(password="from a file").ping() is True
    with pytest.raises(Exception, match="invalid username-password pair"):
        server.client(password="from a file\n").ping()
    with server.connect() as sock:
        sock.sendall(b"PING\r\n")
        assert recv_until(sock) == b"-NOAUTH Authentication required.\r\n"
    assert "from a file" not in open(f"/proc/{server.pid}/cmdline").read()


def test_the_password_from_the_environment(make_server):
    server = make_server(env={"COPSE_REQUIREPASS": "from the environment"})
    assert server.client(password="from the environment").ping() is True
    with pytest.raises(Exception, match="invalid username-password pair"):
        server.client(password="from the").ping()
    # A flag wins, and says the password it got is visible to every local user.
    flagged = make_server("--requirepass", "flag", env={"COPSE_REQUIREPASS": "env"})
    assert flagged.client(password="flag").ping() is True
    assert "visible to every local user" in flagged.log_text()


def test_an_empty_or_missing_password_file_is_refused_at_start(tmp_path):
    import subprocess

    from support import COPSE_BIN

    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, words in [(empty, "is empty"), (tmp_path / "missing", "cannot read")]:
        result = subprocess.run(
            [str(COPSE_BIN), "--path", str(tmp_path / "data"), "serve", "--port", "0",
             "--requirepass-file", str(path)],
            capture_output=True, text=True, timeout=15,
        )
        assert result.returncode == 3, (path, result.returncode, result.stderr)
        assert words in result.stderr, result.stderr


def test_a_client_that_never_reads_is_closed_at_the_auth_timeout_too(make_server):
    """Review finding: the AUTH timeout was checked only while reading, so a client that sent
    PINGs without ever reading their -NOAUTH replies filled its socket, the server's write
    blocked, and the connection held its descriptor and a maxclients slot for good. Writes now
    end at the same deadline."""
    server = make_server("--requirepass", "pw", "--auth-timeout", "1")
    admin = server.client(password="pw")
    stubborn = socket.create_connection(("127.0.0.1", server.port))
    stubborn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stubborn.setblocking(False)
    try:
        started = time.monotonic()
        sent = 0
        while time.monotonic() - started < 0.8:
            try:
                sent += stubborn.send(b"PING\r\n" * 4096)
            except BlockingIOError:
                time.sleep(0.01)
        assert sent > 1_000_000, f"the client only managed to send {sent} bytes"
        # Only the admin connection may remain once the stubborn one timed out.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if int(admin.info("clients")["connected_clients"]) == 1:
                break
            time.sleep(0.1)
        clients = int(admin.info("clients")["connected_clients"])
        assert clients == 1, f"{clients} clients connected 5 s after a 1 s AUTH timeout"
    finally:
        stubborn.close()
        admin.close()


def test_reset_before_a_large_request_puts_it_under_the_unauthenticated_limits(make_server):
    """Review finding: a request still arriving when RESET made the connection unauthenticated
    went on being parsed under the authenticated limits (its argument count was already read),
    where a fresh parse refuses it at its header."""
    server = make_server("--requirepass", "pw")
    with server.connect() as sock:
        sock.sendall(encode_command("AUTH", "pw") + b"RESET\r\n*100000\r\n$1\r\na\r\n")
        reader = RespReader(sock)
        assert reader.read() == b"OK"
        assert reader.read() == b"RESET"
        error = reader.read()
        assert isinstance(error, Error) and b"unauthenticated multibulk length" in error, error
        assert reader.at_eof()
