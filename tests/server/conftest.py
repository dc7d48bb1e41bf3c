"""Fixtures for the end-to-end tests of `copse serve` (see support.py for the server process).

- `server`: one server per test module; `r` and `rc` are clients on it (`rc` runs a test in
  RESP2 and in RESP3), each emptying the store first.
- `make_server(*flags)`: servers of a test's own (a fresh store, or flags such as
  `--requirepass`); they can be killed and restarted on the same store.
Each server gets SIGTERM at teardown and must exit 0 within 15 s.

Run from the repository root after `cargo build --release -p copse-cli`:
    python3 -m pytest -q tests/server
(`COPSE_BIN=/path/to/copse` tests another binary.)
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from support import COPSE_BIN, DEFAULT_SHARDS, CopseServer, Differential, RedisOracle


def pytest_report_header(config):
    if COPSE_BIN.is_file():
        built = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(COPSE_BIN.stat().st_mtime))
        return f"copse binary: {COPSE_BIN} (built {built})"
    return f"copse binary: {COPSE_BIN} (missing: cargo build --release -p copse-cli)"


@pytest.fixture
def make_server(tmp_path_factory):
    """Starts servers with extra flags for one test: make_server("--maxclients", "2")."""
    started: list[CopseServer] = []

    def make(*extra_args: str, shards: int = DEFAULT_SHARDS, data_dir: Path | None = None,
             fd_limit: tuple[int, int] | None = None, env: dict | None = None) -> CopseServer:
        base = tmp_path_factory.mktemp("copse")
        server = CopseServer(data_dir or base / "data", base, *extra_args, shards=shards,
                             fd_limit=fd_limit, env=env)
        started.append(server)
        return server.start()

    yield make
    failures = []
    for server in started:
        if server.proc is not None:
            try:
                server.stop()
            except BaseException as err:  # report every server, then fail
                failures.append(str(err))
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for a whole test module."""
    base = tmp_path_factory.mktemp("copse")
    server = CopseServer(base / "data", base)
    server.start()
    yield server
    if server.proc is not None:
        server.stop()


@pytest.fixture
def r(server):
    """A RESP2 client on the module's server, with the store emptied first."""
    client = server.client(protocol=2)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def rc(request, server):
    """A client on the module's server in each protocol (the test runs twice), store emptied."""
    client = server.client(protocol=request.param)
    client.flushall()
    client.protocol_version = request.param
    yield client
    client.close()


@pytest.fixture
def hash_key(r):
    """Makes a function creating a hash key with HSET. (It used to skip its tests when HSET
    was missing, so losing the command would have passed silently; now such a test fails.)"""

    def make(key, fields=None):
        fields = fields or {"f": "v"}
        for field, value in fields.items():
            r.execute_command("HSET", key, field, value)
        return key

    return make


@pytest.fixture(scope="session")
def oracle(tmp_path_factory):
    """A redis-server to compare replies with (support.RedisOracle), one per test session."""
    oracle = RedisOracle(tmp_path_factory.mktemp("oracle")).start()
    yield oracle
    oracle.stop()


def differential(server, oracle, protocol: int):
    """A differential pair on an emptied copse and an emptied redis-server, in `protocol`."""
    ours, theirs = server.connect(), oracle.connect()
    pair = Differential(ours, theirs)
    if protocol == 3:
        # HELLO's own reply differs (server name, version): only the protocol is switched.
        for side in (pair.copse, pair.oracle):
            pair._call(side, ("HELLO", "3"))
    pair.both("FLUSHALL")
    return pair, (ours, theirs)


@pytest.fixture
def diff(server, oracle, r):
    """Commands sent to copse and to redis-server alike, replies compared (RESP2)."""
    pair, socks = differential(server, oracle, 2)
    yield pair
    for sock in socks:
        sock.close()


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def diff23(request, server, oracle, r):
    """`diff` in RESP2 and in RESP3 (the test runs twice)."""
    pair, socks = differential(server, oracle, request.param)
    yield pair
    for sock in socks:
        sock.close()
