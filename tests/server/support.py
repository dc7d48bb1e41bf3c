"""What the end-to-end tests of `copse serve` share: the server process and raw-protocol helpers.

Every test here talks to a real server process over TCP. A server is started by `CopseServer`
on a free loopback port with its store in a temporary directory, and is considered up once it
answers PING. On teardown it gets SIGTERM and must exit with status 0 within
`SHUTDOWN_TIMEOUT_S` (a clean shutdown is part of what is tested).

The binary is `$COPSE_BIN`, by default `<repo>/target/release/copse`
(`cargo build --release -p copse-cli`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

REPO = Path(__file__).resolve().parents[2]
COPSE_BIN = Path(os.environ.get("COPSE_BIN", REPO / "target" / "release" / "copse"))

START_TIMEOUT_S = 15.0
SHUTDOWN_TIMEOUT_S = 15.0
# Shards of every test store: more than one, so that multi-key commands cross shards.
DEFAULT_SHARDS = 4


def free_port() -> int:
    """A TCP port that was free a moment ago (bound to 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OutsideHost:
    """A client host outside loopback that exists only in this test's sandbox: a network namespace
    of its own joined to ours by a veth pair (`198.18.N.1` on our side, `198.18.N.2` inside; the
    RFC 2544 test range). A server bound to 0.0.0.0 sees its connections come from a non-loopback
    peer. No traffic goes anywhere but between the two ends of the pair. Needs root (`ip netns`)."""

    CLONE_NEWNET = 0x40000000
    _created = 0

    def __init__(self):
        OutsideHost._created += 1
        index = OutsideHost._created
        tag = f"{os.getpid() % 10000}{index}"
        self.name = f"copse-{tag}"
        self.our_link, their_link = f"cph{tag}", f"cpn{tag}"
        subnet = 100 + (os.getpid() + index) % 100
        self.server_side, self.client_side = f"198.18.{subnet}.1", f"198.18.{subnet}.2"
        steps = [
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", self.our_link, "type", "veth", "peer", "name", their_link],
            ["ip", "link", "set", their_link, "netns", self.name],
            ["ip", "addr", "add", f"{self.server_side}/30", "dev", self.our_link],
            ["ip", "link", "set", self.our_link, "up"],
            ["ip", "netns", "exec", self.name, "ip", "addr", "add", f"{self.client_side}/30", "dev", their_link],
            ["ip", "netns", "exec", self.name, "ip", "link", "set", their_link, "up"],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=10)
            if done.returncode != 0:
                self.close()
                raise RuntimeError(f"{' '.join(step)}: {done.stderr.strip()}")

    def socket(self) -> socket.socket:
        """A TCP socket of the namespace: it keeps the namespace it was created in."""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        ours = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        theirs = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY)
        try:
            if libc.setns(theirs, self.CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the test namespace")
            try:
                return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            finally:
                if libc.setns(ours, self.CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back")
        finally:
            os.close(ours)
            os.close(theirs)

    def connect(self, port: int) -> socket.socket:
        """A connection from the namespace to our side of the pair on `port`."""
        sock = self.socket()
        sock.settimeout(10)
        sock.connect((self.server_side, port))
        return sock

    def close(self):
        subprocess.run(["ip", "link", "del", self.our_link], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)


class ServerFailed(Exception):
    pass


class CopseServer:
    """One `copse serve` process over a store directory; can be restarted on the same store."""

    def __init__(self, data_dir: Path, log_dir: Path, *extra_args: str, shards: int = DEFAULT_SHARDS,
                 fd_limit: tuple[int, int] | None = None, env: dict[str, str] | None = None):
        # fd_limit: the (soft, hard) RLIMIT_NOFILE the server starts with; env: variables to
        # set for it.
        self.fd_limit = fd_limit
        self.env = dict(env or {})
        self.data_dir = Path(data_dir)
        self.log_dir = Path(log_dir)
        self.extra_args = list(extra_args)
        self.shards = shards
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.starts = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "CopseServer":
        if not COPSE_BIN.is_file():
            pytest.fail(
                f"copse binary not found at {COPSE_BIN}: run `cargo build --release -p copse-cli` "
                "or set COPSE_BIN",
                pytrace=False,
            )
        # Another process may take the port between free_port() and the server's bind: retry.
        last_error = None
        for _attempt in range(3):
            try:
                self._start_once(free_port())
                return self
            except ServerFailed as err:
                last_error = err
                if "cannot listen" not in self.log_text():
                    break
        pytest.fail(str(last_error), pytrace=False)

    def _start_once(self, port: int) -> None:
        self.starts += 1
        self.port = port
        self.log_path = self.log_dir / f"copse-{port}-{self.starts}.log"
        command = [
            str(COPSE_BIN),
            "--path",
            str(self.data_dir),
            "--shards",
            str(self.shards),
            "serve",
            # Loopback unless a test binds elsewhere (and then connects to loopback or to this
            # machine's own addresses only).
            *([] if "--bind" in self.extra_args else ["--bind", "127.0.0.1"]),
            "--port",
            str(port),
            *self.extra_args,
        ]
        env = dict(os.environ)
        env.setdefault("COPSE_LOG", "info")
        env["NO_COLOR"] = "1"
        # The server reads its password from here when no flag gives one.
        env.pop("COPSE_REQUIREPASS", None)
        env.update(self.env)
        with open(self.log_path, "wb") as log:
            fd_limit = self.fd_limit

            def limit_fds():
                if fd_limit is not None:
                    import resource
                    resource.setrlimit(resource.RLIMIT_NOFILE, fd_limit)

            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=limit_fds,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(
                    f"copse serve exited with status {self.proc.returncode} while starting "
                    f"({' '.join(command)}):\n{self.log_text()}"
                )
            if self.answers_ping():
                return
            time.sleep(0.02)
        self.proc.kill()
        self.proc.wait()
        raise ServerFailed(
            f"copse serve did not answer PING within {START_TIMEOUT_S} s:\n{self.log_text()}"
        )

    def answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                sock.sendall(b"*1\r\n$4\r\nPING\r\n")
                data = b""
                while not data.endswith(b"\r\n"):
                    chunk = sock.recv(64)
                    if not chunk:
                        break
                    data += chunk
                # With --requirepass the answer is NOAUTH: the server is up all the same.
                return data.startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self) -> int:
        """SIGTERM, then the exit status; fails the test unless it is 0 within the timeout."""
        proc = self.proc
        assert proc is not None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                self.proc = None
                pytest.fail(
                    f"copse serve did not exit within {SHUTDOWN_TIMEOUT_S} s of SIGTERM:\n"
                    f"{self.log_tail()}",
                    pytrace=False,
                )
        status = proc.returncode
        self.proc = None
        assert status == 0, f"copse serve exited with status {status} after SIGTERM:\n{self.log_tail()}"
        return status

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to close anything."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def restart(self) -> "CopseServer":
        """Starts again on the same store (after stop() or kill())."""
        assert self.proc is None
        return self.start()

    # -- inspection --------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def rss_bytes(self) -> int:
        """Resident memory of the server process (VmRSS)."""
        return self._status_bytes("VmRSS:")

    def fd_soft_limit(self) -> int:
        """The server's soft RLIMIT_NOFILE now (from /proc/<pid>/limits)."""
        with open(f"/proc/{self.pid}/limits") as limits:
            for line in limits:
                if line.startswith("Max open files"):
                    return int(line.split()[3])
        raise AssertionError("no 'Max open files' in /proc limits")

    def peak_rss_bytes(self) -> int:
        """The most resident memory the server process has had since it started (VmHWM): a
        test of a memory bound reads it before and after, so a peak between samples counts."""
        return self._status_bytes("VmHWM:")

    def _status_bytes(self, field: str) -> int:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} in /proc status")

    # -- clients -----------------------------------------------------------------------------

    def client(self, protocol: int = 2, **kwargs) -> redis.Redis:
        kwargs.setdefault("socket_timeout", 30)
        # No silent retries: a dropped connection or refused command must show in the test.
        kwargs.setdefault("retry", Retry(NoBackoff(), 0))
        return redis.Redis(host="127.0.0.1", port=self.port, protocol=protocol, **kwargs)

    def connect(self, timeout: float = 10.0) -> socket.socket:
        """A raw TCP connection (no client library)."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def raw_command(client: redis.Redis, *args):
    """Sends one command and returns the parsed reply without redis-py's response callbacks
    (so a test sees what the server sent, as the protocol's types)."""
    connection = client.connection_pool.get_connection()
    try:
        connection.send_command(*args)
        return connection.read_response()
    finally:
        client.connection_pool.release(connection)


def recv_until(sock: socket.socket, terminator: bytes = b"\r\n", limit: int = 1 << 20) -> bytes:
    """Reads until `terminator` arrives or the peer closes; returns what was read."""
    data = b""
    while terminator not in data and len(data) < limit:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def recv_all_until_close(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Reads until the peer closes the connection (fails on timeout: the server must close)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        except socket.timeout:
            raise AssertionError(
                f"the server did not close the connection within {timeout} s; got {data[:200]!r}"
            )
        if not chunk:
            break
        data += chunk
    return data


class Error(bytes):
    """An error reply read by RespReader (its text, without the leading '-')."""


class Simple(bytes):
    """A simple string reply read by RespReader (equal to its bytes; its type tells it from a
    bulk string of the same bytes)."""


class RespReader:
    """Reads replies from a raw socket, for tests that bypass client libraries.

    Returns bytes for simple strings and bulks, `Error` for errors, int for integers, None for
    nulls, lists for arrays and sets, dicts for maps, and ("verbatim", fmt, text) / ("double",
    text) / bool for the RESP3 types that have no plain Python counterpart.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.closed = False

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            self.closed = True
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def _line(self) -> bytes:
        while True:
            at = self.buf.find(b"\r\n")
            if at >= 0:
                line = bytes(self.buf[:at])
                del self.buf[: at + 2]
                return line
            self._fill()

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            self._fill()
        data = bytes(self.buf[:n])
        assert self.buf[n : n + 2] == b"\r\n", "bulk not followed by CRLF"
        del self.buf[: n + 2]
        return data

    def read(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return Simple(rest)
        if kind == b"-":
            return Error(rest)
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind in (b"*", b"~", b">"):
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        if kind == b"%":
            return {self._hashable(self.read()): self.read() for _ in range(int(rest))}
        if kind == b"_":
            return None
        if kind == b"#":
            return rest == b"t"
        if kind == b",":
            return ("double", rest)
        if kind == b"=":
            data = self._exact(int(rest))
            return ("verbatim", data[:3], data[4:])
        raise AssertionError(f"unknown reply type in line {line[:100]!r}")

    @staticmethod
    def _hashable(value):
        return tuple(value) if isinstance(value, list) else value

    def at_eof(self, timeout: float = 5.0) -> bool:
        """Whether the server closes the connection (nothing more buffered) within `timeout`."""
        if self.buf:
            return False
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False
        if chunk:
            self.buf += chunk
            return False
        return True


def encode_command(*args) -> bytes:
    """The RESP multibulk encoding of one command."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


def connect_admitted(server, timeout: float = 5.0) -> socket.socket:
    """A raw connection that the server admitted (answered PING). Retries while the server
    still counts connections that just closed (it notices a close asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        sock = server.connect()
        sock.sendall(b"PING\r\n")
        reply = recv_until(sock)
        if reply == b"+PONG\r\n":
            return sock
        sock.close()
        assert reply.startswith(b"-ERR max number of clients reached"), reply
        assert time.monotonic() < deadline, "connections that closed still count against maxclients"
        time.sleep(0.05)


def run_clients(server, count: int, work) -> None:
    """Runs `work(client, n)` for n in 0..count, each on its own thread with its own connection,
    and fails with every exception a thread raised."""
    errors = []

    def body(n):
        client = server.client()
        try:
            work(client, n)
        except Exception as err:  # reported by the calling thread
            errors.append(err)
        finally:
            client.close()

    threads = [threading.Thread(target=body, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors


def assert_store_checks(server) -> None:
    """`copse check` (offline, on the stopped or killed server's store) finds nothing wrong."""
    check = subprocess.run(
        [str(COPSE_BIN), "--path", str(server.data_dir), "check"],
        capture_output=True, text=True, timeout=60,
    )
    assert check.returncode == 0, f"copse check: exit {check.returncode}\n{check.stdout[-2000:]}{check.stderr[-2000:]}"


class RedisOracle:
    """A redis-server (installed by `make test-deps`) to compare copse's replies with: the
    differential tests send both the same commands and compare the replies, errors included.
    In memory only (no RDB, no AOF): it answers, it keeps nothing."""

    def __init__(self, log_dir: Path):
        self.binary = shutil.which("redis-server")
        self.log_dir = Path(log_dir)
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisOracle":
        if self.binary is None:
            raise ServerFailed("redis-server is not installed: run `make test-deps`")
        self.port = free_port()
        log = open(self.log_dir / "redis-oracle.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(encode_command("PING"))
                    if recv_until(sock).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise ServerFailed("redis-server did not start")

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
            self.proc = None


class Differential:
    """One raw connection to copse and one to the oracle: `both(*args)` sends a command to each
    and asserts the two replies are equal (types, bytes, error texts), then returns it."""

    def __init__(self, copse_sock: socket.socket, oracle_sock: socket.socket):
        self.copse = (copse_sock, RespReader(copse_sock))
        self.oracle = (oracle_sock, RespReader(oracle_sock))

    @staticmethod
    def _call(side, args):
        sock, reader = side
        sock.sendall(encode_command(*args))
        return reader.read()

    def both(self, *args, unordered: bool = False):
        """`unordered`: the reply is a collection whose order neither server promises (SMEMBERS,
        SINTER, ...): compared sorted, at every level."""
        ours = self._call(self.copse, args)
        theirs = self._call(self.oracle, args)
        if unordered:
            ours, theirs = _sorted_deep(ours), _sorted_deep(theirs)
        assert ours == theirs and type(ours) is type(theirs), (
            f"{' '.join(shown(arg) for arg in args)}: copse answered {shown(ours)}, "
            f"redis-server {shown(theirs)}")
        return ours


def shown(value) -> str:
    """A value for a failure message: long byte strings (a 1 MiB key) shortened."""
    if isinstance(value, (bytes, bytearray)) and len(value) > 48:
        return f"<{len(value)} bytes {bytes(value[:16])!r}...>"
    if isinstance(value, list):
        return "[" + ", ".join(shown(item) for item in value) + "]"
    return value if isinstance(value, str) else repr(value)


def _sorted_deep(reply):
    if isinstance(reply, list):
        return sorted((_sorted_deep(item) for item in reply), key=repr)
    return reply


def run_script(diff: Differential, script: str, unordered: frozenset = frozenset()) -> None:
    """Sends each line of `script` (a command, words split on spaces) to both servers; replies
    of the commands named in `unordered` are compared sorted."""
    for line in script.strip().splitlines():
        words = line.split()
        diff.both(*words, unordered=words[0].upper() in unordered)


def assert_groups_survive_kills(server, groups, write_group, cycles: int, seed: int,
                                what: str = "write") -> None:
    """Kill loop of the atomic multi-key writes (transactions, scripts): one writer per group of
    keys calls `write_group(client, keys, token)` with tokens `cycle:n` until the server is
    killed; after each restart every group holds one token (all its keys written together or
    none), at least the last one acknowledged."""
    import random as random_module

    rng = random_module.Random(seed)
    for cycle in range(cycles):
        acked = [0] * len(groups)
        errors: list = []

        def write(writer):
            client = server.client(socket_timeout=20)
            token = 0
            try:
                while True:
                    token += 1
                    write_group(client, groups[writer], f"{cycle}:{token}")
                    acked[writer] = token
            except (redis.ConnectionError, redis.TimeoutError):
                return
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)
            finally:
                client.close()

        threads = [threading.Thread(target=write, args=(writer,)) for writer in range(len(groups))]
        for thread in threads:
            thread.start()
        time.sleep(rng.uniform(0.5, 1.5))
        server.kill()
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive()
        assert not errors, errors
        server.restart()
        checker = server.client()
        for writer, keys in enumerate(groups):
            values = checker.mget(keys)
            assert len(set(values)) == 1, f"cycle {cycle}: a {what} was split: {values}"
            assert acked[writer] > 0, f"cycle {cycle}: writer {writer} saw nothing acknowledged"
            cycle_of, token = values[0].decode().split(":")
            assert int(cycle_of) == cycle and int(token) >= acked[writer], (values[0], acked)
        checker.close()
