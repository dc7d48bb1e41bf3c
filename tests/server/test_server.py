"""Connection and server commands: PING, ECHO, HELLO, AUTH, SELECT, QUIT, RESET, CLIENT,
COMMAND, CONFIG, INFO, DBSIZE, TIME, and the errors every command shares (unknown command,
arity). Where RESP2 and RESP3 replies differ on the wire, a raw socket checks the bytes."""

from __future__ import annotations

import random
import socket
import subprocess
import time

import pytest
import redis

from support import (
    COPSE_BIN,
    Error,
    RespReader,
    connect_admitted,
    encode_command,
    free_port,
    raw_command,
    recv_all_until_close,
)

PASSWORD = "s3cret pass"


class Raw:
    """A raw connection: send one command, read one reply."""

    def __init__(self, server, sock=None):
        self.sock = sock or server.connect()
        self.reader = RespReader(self.sock)

    def __call__(self, *args):
        self.sock.sendall(encode_command(*args))
        return self.reader.read()

    def send(self, data: bytes):
        self.sock.sendall(data)

    def read(self):
        return self.reader.read()

    def close(self):
        self.sock.close()


@pytest.fixture
def raw(server):
    connection = Raw(server)
    yield connection
    connection.close()


# -- PING, ECHO, unknown commands, arity -------------------------------------------------------


def test_ping_and_echo(rc):
    assert rc.ping() is True
    assert raw_command(rc, "PING", "hello") == b"hello"
    assert rc.echo("hi there") == b"hi there"
    assert rc.echo(b"\x00\xff\r\n") == b"\x00\xff\r\n"
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'ping' command"):
        rc.execute_command("PING", "a", "b")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'echo' command"):
        rc.execute_command("ECHO")


def test_ping_on_the_wire(raw):
    assert raw("PING") == b"PONG"
    raw.send(b"*1\r\n$4\r\nping\r\n")
    assert raw.reader.read() == b"PONG"
    raw.send(encode_command("PING", "x y"))
    assert raw.sock.recv(100) == b"$3\r\nx y\r\n"


def test_unknown_command_error_text(raw, rc):
    assert raw("FOOBAR", "a", "b c") == Error(
        b"ERR unknown command 'FOOBAR', with args beginning with: 'a' 'b c' "
    )
    assert raw("nosuch") == Error(b"ERR unknown command 'nosuch', with args beginning with: ")
    with pytest.raises(redis.ResponseError, match="unknown command 'HSETX'"):
        rc.execute_command("HSETX", "k", "f", "v")
    # The connection is fine afterwards.
    assert raw("PING") == b"PONG"


def test_arity_errors_name_the_command(raw):
    assert raw("GET") == Error(b"ERR wrong number of arguments for 'get' command")
    assert raw("Set", "k") == Error(b"ERR wrong number of arguments for 'set' command")
    assert raw("DBSIZE", "x") == Error(b"ERR wrong number of arguments for 'dbsize' command")
    assert raw("EXISTS") == Error(b"ERR wrong number of arguments for 'exists' command")


def test_commands_are_case_insensitive(raw):
    assert raw("sEt", "case", "v") == b"OK"
    assert raw("get", "case") == b"v"
    assert raw("GET", "case") == b"v"


# -- HELLO and protocol switching --------------------------------------------------------------


def test_hello_without_version_answers_in_the_current_protocol(raw):
    reply = raw("HELLO")
    assert isinstance(reply, list), "RESP2: the map is a flat array"
    fields = dict(zip(reply[::2], reply[1::2]))
    assert fields[b"server"] == b"redis"
    assert fields[b"version"] == b"7.0.15"
    assert fields[b"proto"] == 2
    assert fields[b"mode"] == b"standalone"
    assert fields[b"role"] == b"master"
    assert fields[b"modules"] == []
    assert fields[b"id"] == raw("CLIENT", "ID")


def test_hello_3_switches_to_resp3_and_hello_2_back(raw):
    raw.send(encode_command("HELLO", "3"))
    assert raw.sock.recv(1, socket.MSG_PEEK) == b"%", "RESP3: HELLO answers a map"
    reply = raw.read()
    assert reply[b"proto"] == 3
    assert reply[b"server"] == b"redis"
    # RESP3 encodings of the commands after it.
    raw.send(encode_command("GET", "missing:hello"))
    assert raw.sock.recv(100) == b"_\r\n"
    raw.send(encode_command("CONFIG", "GET", "maxclients"))
    assert raw.sock.recv(1, socket.MSG_PEEK) == b"%"
    assert raw.read() == {b"maxclients": b"10000"}
    raw.send(encode_command("COMMAND", "INFO", "get"))
    assert raw.read() == [[b"get", 2, [b"readonly", b"fast"], 1, 1, 1, [], [], [], []]]
    raw.send(encode_command("CLIENT", "INFO"))
    assert raw.sock.recv(1, socket.MSG_PEEK) == b"=", "RESP3: CLIENT INFO is verbatim text"
    kind, fmt, text = raw.read()
    assert (kind, fmt) == ("verbatim", b"txt") and b"resp=3" in text
    # Back to RESP2.
    reply = raw("HELLO", "2")
    assert isinstance(reply, list) and dict(zip(reply[::2], reply[1::2]))[b"proto"] == 2
    raw.send(encode_command("GET", "missing:hello"))
    assert raw.sock.recv(100) == b"$-1\r\n"
    raw.send(encode_command("CONFIG", "GET", "maxclients"))
    assert raw.sock.recv(100) == b"*2\r\n$10\r\nmaxclients\r\n$5\r\n10000\r\n"
    raw.send(encode_command("CLIENT", "INFO"))
    assert raw.sock.recv(1, socket.MSG_PEEK) == b"$"
    assert b"resp=2" in raw.read()


def test_resp3_null_array_and_sets(raw):
    raw("HELLO", "3")
    raw.send(encode_command("COMMAND", "INFO", "nosuchcommand"))
    assert raw.sock.recv(100) == b"*1\r\n_\r\n"
    raw.send(encode_command("COMMAND", "INFO", "ping"))
    data = raw.sock.recv(1000)
    assert data.startswith(b"*1\r\n*10\r\n$4\r\nping\r\n:-1\r\n~1\r\n+fast\r\n"), data
    raw("HELLO", "2")
    raw.send(encode_command("COMMAND", "INFO", "nosuchcommand"))
    assert raw.sock.recv(100) == b"*1\r\n*-1\r\n"


def test_hello_errors(raw):
    assert raw("HELLO", "4") == Error(b"NOPROTO unsupported protocol version")
    assert raw("HELLO", "1") == Error(b"NOPROTO unsupported protocol version")
    reply = raw("HELLO", "three")
    assert isinstance(reply, Error) and b"Protocol version is not an integer" in reply
    reply = raw("HELLO", "3", "BOGUS")
    assert isinstance(reply, Error) and reply.startswith(b"ERR Syntax error in HELLO option")
    reply = raw("HELLO", "3", "SETNAME")
    assert isinstance(reply, Error), "SETNAME without a name"
    # None of those changed the protocol.
    raw.send(encode_command("GET", "missing:hello"))
    assert raw.sock.recv(100) == b"$-1\r\n"


def test_hello_setname(raw):
    reply = raw("HELLO", "3", "SETNAME", "my-conn")
    assert reply[b"proto"] == 3
    assert raw("CLIENT", "GETNAME") == b"my-conn"
    reply = raw("HELLO", "2", "SETNAME", "bad name")
    assert isinstance(reply, Error) and b"cannot contain spaces" in reply
    assert raw("CLIENT", "GETNAME") == b"my-conn"


def test_default_user_without_a_password_accepts_any_password(raw):
    assert raw("AUTH", "default", "anything") == b"OK"
    assert isinstance(raw("HELLO", "3", "AUTH", "default", "anything"), dict)


# -- AUTH --------------------------------------------------------------------------------------


@pytest.fixture
def locked_server(make_server):
    return make_server("--requirepass", PASSWORD)


def test_auth_with_requirepass(locked_server):
    raw = Raw(locked_server)
    try:
        assert raw("GET", "k") == Error(b"NOAUTH Authentication required.")
        assert raw("PING") == Error(b"NOAUTH Authentication required.")
        assert raw("CLIENT", "ID") == Error(b"NOAUTH Authentication required.")
        assert raw("AUTH", "wrong") == Error(
            b"WRONGPASS invalid username-password pair or user is disabled."
        )
        assert raw("AUTH", "nobody", PASSWORD) == Error(
            b"WRONGPASS invalid username-password pair or user is disabled."
        )
        assert raw("GET", "k") == Error(b"NOAUTH Authentication required.")
        assert raw("AUTH", PASSWORD) == b"OK"
        assert raw("SET", "k", "v") == b"OK"
        assert raw("GET", "k") == b"v"
        assert raw("AUTH", "default", PASSWORD) == b"OK"
        # RESET logs the connection out again.
        assert raw("RESET") == b"RESET"
        assert raw("GET", "k") == Error(b"NOAUTH Authentication required.")
        assert raw("AUTH", "default", PASSWORD) == b"OK"
        assert raw("GET", "k") == b"v"
    finally:
        raw.close()


def test_hello_auth_with_requirepass(locked_server):
    raw = Raw(locked_server)
    try:
        reply = raw("HELLO", "3")
        assert isinstance(reply, Error) and reply.startswith(b"NOAUTH")
        reply = raw("HELLO", "3", "AUTH", "default", "wrong")
        assert isinstance(reply, Error) and reply.startswith(b"WRONGPASS")
        reply = raw("HELLO", "3", "AUTH", "default", PASSWORD, "SETNAME", "authed")
        assert isinstance(reply, dict) and reply[b"proto"] == 3
        assert raw("CLIENT", "GETNAME") == b"authed"
        assert raw("PING") == b"PONG"
    finally:
        raw.close()


def test_quit_before_auth(locked_server):
    with locked_server.connect() as sock:
        sock.sendall(encode_command("QUIT"))
        assert recv_all_until_close(sock) == b"+OK\r\n"


@pytest.mark.parametrize("protocol", [2, 3])
def test_redis_py_with_a_password(locked_server, protocol):
    client = locked_server.client(protocol=protocol, password=PASSWORD)
    assert client.set("k", "v") is True
    assert client.get("k") == b"v"
    client.close()
    anonymous = locked_server.client(protocol=2)
    with pytest.raises(redis.AuthenticationError):
        anonymous.get("k")
    anonymous.close()
    wrong = locked_server.client(protocol=protocol, password="wrong")
    with pytest.raises(redis.AuthenticationError):
        wrong.get("k")
    wrong.close()


def test_auth_without_a_password_configured(raw):
    reply = raw("AUTH", "anything")
    assert isinstance(reply, Error)
    assert reply.startswith(b"ERR AUTH <password> called without any password configured")
    assert raw("AUTH", "a", "b", "c") == Error(b"ERR syntax error")


def test_config_set_requirepass_applies_to_new_connections(make_server):
    server = make_server()
    admin = Raw(server)
    try:
        assert admin("CONFIG", "SET", "requirepass", "newpass") == b"OK"
        # The connection that set it stays authenticated.
        assert admin("PING") == b"PONG"
        assert admin("CONFIG", "GET", "requirepass") == [b"requirepass", b"newpass"]
        other = Raw(server)
        assert other("PING") == Error(b"NOAUTH Authentication required.")
        assert other("AUTH", "newpass") == b"OK"
        assert other("PING") == b"PONG"
        other.close()
        assert admin("CONFIG", "SET", "requirepass", "") == b"OK"
        third = Raw(server)
        assert third("PING") == b"PONG"
        third.close()
    finally:
        admin.close()


# -- SELECT, QUIT, RESET -----------------------------------------------------------------------


def test_select(rc):
    assert rc.select(0) is True
    assert rc.select(15) is True
    with pytest.raises(redis.ResponseError, match="DB index is out of range"):
        rc.select(16)
    with pytest.raises(redis.ResponseError, match="DB index is out of range"):
        rc.execute_command("SELECT", "-1")
    with pytest.raises(redis.ResponseError, match="value is not an integer or out of range"):
        rc.execute_command("SELECT", "zero")


def test_redis_py_with_db_1_uses_database_1(server):
    client = server.client(db=1)
    client.set("in-db-1", "v")
    assert client.get("in-db-1") == b"v"
    assert client.client_info()["db"] == 1
    other = server.client()
    assert other.get("in-db-1") is None
    other.execute_command("SELECT", "1")
    assert other.get("in-db-1") == b"v"
    other.delete("in-db-1")
    client.close()
    other.close()


def test_quit_answers_ok_and_closes(server):
    with server.connect() as sock:
        sock.sendall(encode_command("SET", "quit:k", "v") + encode_command("QUIT") + encode_command("PING"))
        assert recv_all_until_close(sock) == b"+OK\r\n+OK\r\n", "nothing after QUIT is run"


def test_reset(raw):
    raw("HELLO", "3", "SETNAME", "before-reset")
    raw.send(encode_command("RESET"))
    assert raw.sock.recv(100) == b"+RESET\r\n"
    assert raw("CLIENT", "GETNAME") is None
    raw("SELECT", "3")
    raw.send(encode_command("RESET"))
    assert raw.sock.recv(100) == b"+RESET\r\n"
    assert b"db=0" in raw("CLIENT", "INFO"), "RESET goes back to database 0"
    raw.send(encode_command("GET", "missing:reset"))
    assert raw.sock.recv(100) == b"$-1\r\n", "RESET goes back to RESP2"
    assert raw("RESET", "x") == Error(b"ERR wrong number of arguments for 'reset' command")


# -- CLIENT ------------------------------------------------------------------------------------


def test_client_id_setname_getname(server, rc):
    first = rc.client_id()
    assert isinstance(first, int) and first > 0
    other = server.client(protocol=2)
    second = other.client_id()
    assert second != first
    assert rc.client_getname() is None
    assert rc.client_setname("worker-1") is True
    assert rc.client_getname() in (b"worker-1", "worker-1")
    with pytest.raises(redis.ResponseError, match="cannot contain spaces"):
        rc.client_setname("has space")
    with pytest.raises(redis.ResponseError, match="cannot contain spaces"):
        rc.client_setname("new\nline")
    assert rc.client_getname() in (b"worker-1", "worker-1")
    other.close()


def test_client_list_and_info(server, rc):
    rc.client_setname("lister")
    my_id = rc.client_id()
    other = server.client(protocol=2)
    other.client_setname("other-one")
    other_id = other.client_id()
    clients = rc.client_list()
    by_id = {int(c["id"]): c for c in clients}
    assert my_id in by_id and other_id in by_id
    assert by_id[my_id]["name"] == "lister"
    assert by_id[other_id]["name"] == "other-one"
    assert by_id[my_id]["resp"] == str(rc.protocol_version)
    assert by_id[other_id]["resp"] == "2"
    assert by_id[my_id]["addr"].startswith("127.0.0.1:")
    assert by_id[my_id]["laddr"] == f"127.0.0.1:{server.port}"
    assert by_id[my_id]["db"] == "0"
    info = rc.client_info()
    assert int(info["id"]) == my_id
    assert info["name"] == "lister"
    other.close()


def test_client_list_forgets_closed_connections(server, r):
    other = server.client()
    other_id = other.client_id()
    other.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if other_id not in {int(c["id"]) for c in r.client_list()}:
            return
        time.sleep(0.05)
    raise AssertionError("a closed connection stays in CLIENT LIST")


def test_client_errors(raw):
    reply = raw("CLIENT", "NOSUCH")
    assert isinstance(reply, Error) and b"unknown subcommand" in reply and b"CLIENT HELP" in reply
    reply = raw("CLIENT", "ID", "extra")
    assert isinstance(reply, Error)
    assert raw("CLIENT") == Error(b"ERR wrong number of arguments for 'client' command")


# -- COMMAND -----------------------------------------------------------------------------------


EXPECTED_COMMANDS = {
    "get", "set", "setnx", "getset", "getdel", "mget", "mset", "msetnx", "strlen", "append",
    "getrange", "setrange", "incr", "decr", "incrby", "decrby", "incrbyfloat",
    "del", "unlink", "exists", "type", "scan", "keys", "dbsize", "flushall", "flushdb",
    "ping", "echo", "hello", "auth", "select", "quit", "reset", "client", "command", "config",
    "info", "time",
}


def test_command_count_list_and_info(rc):
    names = {name.decode() for name in raw_command(rc, "COMMAND", "LIST")}
    assert EXPECTED_COMMANDS <= names
    assert rc.command_count() == len(names)
    every = raw_command(rc, "COMMAND")
    assert len(every) == len(names)
    assert raw_command(rc, "COMMAND", "INFO") is not None
    info = raw_command(rc, "COMMAND", "INFO", "get", "MSET", "nosuch")
    assert len(info) == 3
    get, mset, missing = info
    assert get[:6] == [b"get", 2, [b"readonly", b"fast"], 1, 1, 1]
    assert mset[:6] == [b"mset", -3, [b"write"], 1, -1, 2]
    assert missing is None
    parsed = rc.command()
    assert parsed["set"]["arity"] == -3


def test_command_docs(rc):
    docs = raw_command(rc, "COMMAND", "DOCS", "get", "nosuch")
    if isinstance(docs, list):  # RESP2: flat
        docs = dict(zip(docs[::2], [dict(zip(d[::2], d[1::2])) for d in docs[1::2]]))
    assert list(docs) == [b"get"], "unknown commands are left out"
    assert docs[b"get"][b"summary"]
    assert docs[b"get"][b"group"] == b"string"
    every = raw_command(rc, "COMMAND", "DOCS")
    assert len(every) in (rc.command_count(), 2 * rc.command_count())


def test_command_errors(rc):
    with pytest.raises(redis.ResponseError, match="unknown subcommand"):
        rc.execute_command("COMMAND", "NOSUCH")


# -- CONFIG ------------------------------------------------------------------------------------


def test_config_get(rc, server):
    values = rc.config_get("*")
    for name in ("maxclients", "timeout", "requirepass", "proto-max-bulk-len", "port", "bind",
                 "dir", "save", "appendonly", "databases"):
        assert name in values, name
    assert values["maxclients"] == "10000"
    assert values["timeout"] == "0"
    assert values["requirepass"] == ""
    assert values["proto-max-bulk-len"] == str(16 * 1024 * 1024)
    assert values["port"] == str(server.port)
    assert values["databases"] == "16"
    assert rc.config_get("max*") == {"maxclients": "10000"}
    assert rc.config_get("nosuch") == {}
    both = raw_command(rc, "CONFIG", "GET", "timeout", "maxclients", "time*")
    if isinstance(both, list):
        both = dict(zip(both[::2], both[1::2]))
    assert both == {b"timeout": b"0", b"maxclients": b"10000"}, "each setting once"


def test_config_set(make_server):
    server = make_server()
    client = server.client()
    assert client.config_set("maxclients", 50) is True
    assert client.config_get("maxclients") == {"maxclients": "50"}
    assert client.config_set("timeout", 100) is True
    assert client.config_get("timeout") == {"timeout": "100"}
    assert client.config_set("proto-max-bulk-len", 1000) is True
    assert client.config_get("proto-max-bulk-len") == {"proto-max-bulk-len": "1000"}
    assert client.execute_command("CONFIG", "SET", "timeout", "0", "maxclients", "60") in (True, b"OK")
    assert client.config_get("timeout") == {"timeout": "0"}
    assert client.config_get("maxclients") == {"maxclients": "60"}
    assert client.execute_command("CONFIG", "RESETSTAT") in (True, b"OK")
    client.close()


def test_config_set_errors_change_nothing(make_server):
    server = make_server()
    client = server.client()
    with pytest.raises(redis.ResponseError, match="Unknown option or number of arguments for CONFIG SET - 'nosuch'"):
        client.config_set("nosuch", "1")
    for name, value in [("maxclients", "0"), ("maxclients", "lots"), ("timeout", "-1"),
                        ("proto-max-bulk-len", "0"), ("proto-max-bulk-len", str(16 * 1024 * 1024 + 1))]:
        with pytest.raises(redis.ResponseError, match=f"CONFIG SET failed \\(possibly related to argument '{name}'\\)"):
            client.config_set(name, value)
    # All or nothing: a bad pair after a good one applies neither.
    with pytest.raises(redis.ResponseError):
        client.execute_command("CONFIG", "SET", "timeout", "5", "nosuch", "1")
    assert client.config_get("timeout") == {"timeout": "0"}
    with pytest.raises(redis.ResponseError, match="wrong number of arguments|unknown subcommand"):
        client.execute_command("CONFIG", "SET", "timeout")
    with pytest.raises(redis.ResponseError, match="unknown subcommand"):
        client.execute_command("CONFIG", "REWRITE")
    assert client.config_get("maxclients") == {"maxclients": "10000"}
    client.close()


def test_config_set_proto_max_bulk_len_applies_to_new_requests(make_server):
    server = make_server()
    client = server.client()
    client.config_set("proto-max-bulk-len", 32)
    with server.connect() as sock:
        sock.sendall(encode_command("SET", "k", b"a" * 32) + encode_command("SET", "k", b"b" * 33))
        assert recv_all_until_close(sock) == b"+OK\r\n-ERR Protocol error: invalid bulk length\r\n"
    assert client.get("k") == b"a" * 32
    client.config_set("proto-max-bulk-len", 16 * 1024 * 1024)
    assert client.set("k", b"b" * 33) is True
    client.close()


def test_config_set_maxclients_applies_at_once(make_server):
    server = make_server()
    admin = Raw(server)
    try:
        assert admin("CONFIG", "SET", "maxclients", "1") == b"OK"
        with server.connect() as sock:
            assert recv_all_until_close(sock) == b"-ERR max number of clients reached\r\n"
        assert admin("CONFIG", "SET", "maxclients", "10") == b"OK"
        with server.connect() as sock:
            sock.sendall(encode_command("PING"))
            assert sock.recv(100) == b"+PONG\r\n"
    finally:
        admin.close()


# -- INFO, DBSIZE, TIME ------------------------------------------------------------------------


INFO_SECTIONS = ["Server", "Clients", "Memory", "Persistence", "Stats", "Keyspace", "Copse"]


def test_info_has_every_section(rc, server):
    rc.mset({"i1": 1, "i2": 2})
    text = raw_command(rc, "INFO")
    if isinstance(text, tuple) or not isinstance(text, (bytes, str)):
        text = text[-1]
    text = text.decode() if isinstance(text, bytes) else text
    headers = [line[2:] for line in text.split("\r\n") if line.startswith("# ")]
    assert headers == INFO_SECTIONS
    for line in text.split("\r\n"):
        assert line == "" or line.startswith("# ") or ":" in line, line
    info = rc.info()
    assert info["redis_version"] == "7.0.15"
    assert info["tcp_port"] == server.port
    assert info["process_id"] == server.pid
    assert info["connected_clients"] >= 1
    assert info["maxclients"] == 10000
    assert info["used_memory"] > 0
    assert info["aof_enabled"] == 0
    assert info["copse_durability"] == "flush-per-round"
    assert info["total_commands_processed"] > 0
    assert info["db0"] == {"keys": 2, "expires": 0, "avg_ttl": 0}
    assert info["shards"] == 4
    assert info["items"] >= 2


@pytest.mark.parametrize("section", ["server", "clients", "memory", "persistence", "stats", "keyspace", "copse"])
def test_info_single_section(rc, section):
    rc.set("x", 1)
    info = rc.info(section)
    assert info, section
    text = raw_command(rc, "INFO", section.upper())
    text = text[-1] if isinstance(text, tuple) else text
    text = text.decode() if isinstance(text, bytes) else text
    assert [line for line in text.split("\r\n") if line.startswith("# ")] == [f"# {section.capitalize()}"]


def test_info_copse_section(rc):
    info = rc.info("copse")
    assert info["shards"] == 4
    depths = info["shard_queue_depths"]
    depths = depths if isinstance(depths, list) else str(depths).split(",")
    assert len(depths) == 4
    for name in ("items", "file_bytes", "index_bytes_per_item", "cache_hit_rate",
                 "device_reads", "device_writes", "device_flushes"):
        assert name in info, name


def _copse_classes(client) -> dict[int, dict[str, str]]:
    """INFO copse's `class_N:key=value,...` lines, parsed from the raw text."""
    text = raw_command(client, "INFO", "copse")
    text = text[-1] if isinstance(text, tuple) else text
    text = text.decode() if isinstance(text, bytes) else text
    classes = {}
    for line in text.split("\r\n"):
        if line.startswith("class_"):
            name, fields = line.split(":", 1)
            classes[int(name[len("class_"):])] = dict(field.split("=", 1) for field in fields.split(","))
    return classes


def test_placement_flags_make_an_appending_store_that_collects_and_keeps_its_layout(make_server):
    server = make_server("--placement", "append", "--space-amplification-max", "1.2")
    client = server.client()
    values = {}
    # Each round writes keys drawn at random (some several times, some not at all), so that
    # old blocks keep a few live records and do not die whole (a block whose records all died
    # is reused without the collector's help, docs/placement.md). Enough of them that every
    # shard's writes pass the room the collector leaves a class of a few blocks
    # (`GC_ROOM_BLOCKS_MIN`, 256 KiB blocks).
    order = random.Random(7)
    keys = 8000
    for round_number in range(8):
        pipe = client.pipeline(transaction=False)
        for key in (order.randrange(keys) for _ in range(keys)):
            values[f"k{key}"] = f"{round_number}-{key}-".ljust(90, "v").encode()
            pipe.set(f"k{key}", values[f"k{key}"])
        pipe.execute()
    assert client.info("copse")["placement"] == "append"
    classes = _copse_classes(client)
    assert classes and all(fields["placement"] == "append" for fields in classes.values()), classes
    used = [fields for fields in classes.values() if int(fields["live_bytes"]) > 0]
    assert used, classes
    # Eight versions of each item under a 1.2 ceiling: the collector must have emptied blocks.
    assert sum(int(fields["gc_blocks_freed"]) for fields in used) > 0, used
    # A restart without the flag keeps the store's layout and every latest value.
    server.stop()
    server.extra_args = []
    server.restart()
    client = server.client()
    assert client.info("copse")["placement"] == "append"
    assert all(fields["placement"] == "append" for fields in _copse_classes(client).values())
    keys = sorted(values)
    assert client.mget(keys) == [values[key] for key in keys]


def test_info_all_everything_and_unknown(rc):
    assert set(rc.info("all")) == set(rc.info())
    assert set(rc.info("everything")) == set(rc.info())
    text = raw_command(rc, "INFO", "nosuchsection")
    text = text[-1] if isinstance(text, tuple) else text
    assert text in (b"", ""), text
    combined = rc.execute_command("INFO", "server", "copse")
    assert "redis_version" in combined and "shards" in combined


def test_info_keyspace_is_empty_on_an_empty_store(rc):
    assert rc.info("keyspace") == {}


def test_info_counts_connections_and_rejections(make_server):
    server = make_server("--maxclients", "2")
    first = Raw(server, connect_admitted(server))
    second = connect_admitted(server)
    try:
        before = _info(first, "stats")
        with server.connect() as rejected:
            assert recv_all_until_close(rejected).startswith(b"-ERR max number of clients reached")
        after = _info(first, "stats")
    finally:
        first.close()
        second.close()
    assert after["rejected_connections"] == before["rejected_connections"] + 1
    assert after["total_connections_received"] == before["total_connections_received"] + 1


def _info(raw: Raw, section: str) -> dict:
    text = raw("INFO", section).decode()
    return {
        name: int(value) if value.isdigit() else value
        for name, _, value in (line.partition(":") for line in text.split("\r\n"))
        if value
    }


def test_dbsize_and_time(rc):
    assert rc.dbsize() == 0
    rc.set("a", 1)
    assert rc.dbsize() == 1
    seconds, micros = rc.time()
    assert abs(seconds - time.time()) < 5
    assert 0 <= micros < 1_000_000
    reply = raw_command(rc, "TIME")
    assert len(reply) == 2 and all(isinstance(part, bytes) and part.isdigit() for part in reply)


# -- the config file, flags, metrics -----------------------------------------------------------


def write_config(tmp_path, text: str):
    path = tmp_path / "copse.toml"
    path.write_text(text)
    return str(path)


def test_config_file_settings_and_flag_overrides(make_server, tmp_path):
    config = write_config(
        tmp_path,
        'maxclients = 5\ntimeout_secs = 7\nrequirepass = "from-file"\n'
        "proto_max_bulk_len = 4096\nclient_output_bytes_max = 1000000\n",
    )
    server = make_server("--config", config, "--maxclients", "9")
    client = server.client(password="from-file")
    values = client.config_get("*")
    assert values["maxclients"] == "9", "a flag overrides the file"
    assert values["timeout"] == "7"
    assert values["requirepass"] == "from-file"
    assert values["proto-max-bulk-len"] == "4096"
    assert values["client-output-buffer-limit"] == "normal 1000000 0 0"
    client.close()


def test_a_reply_over_the_output_limit_closes_the_client(make_server, tmp_path):
    """A reply built from the index (HKEYS: field names only, bounded by the hash limits) is
    checked once encoded: over the limit it is replaced by an error and the client closed.
    Replies of stored values stop as they read instead (test_memory_bounds.py)."""
    config = write_config(tmp_path, "client_output_bytes_max = 1000000\n")
    server = make_server("--config", config)
    client = server.client()
    fields = {f"{i:04}".ljust(1000, "f"): "v" for i in range(2000)}
    for start in range(0, 2000, 500):
        client.hset("h", mapping=dict(list(fields.items())[start : start + 500]))
    client.set("k", b"s" * 600_000)
    with server.connect(timeout=60) as sock:
        sock.sendall(encode_command("GET", "k") + encode_command("HKEYS", "h") + b"PING\r\n")
        data = recv_all_until_close(sock, timeout=60)
    single = b"$600000\r\n" + b"s" * 600_000 + b"\r\n"
    assert data.startswith(single), "the reply before the oversized one is delivered"
    error = data[len(single):]
    assert error.startswith(b"-ERR reply of ") and b"exceeds the client output limit (1000000 bytes)" in error, error[:200]
    assert error.endswith(b"\r\n") and error.count(b"\r\n") == 1, "nothing after the error"
    assert client.info("stats")["copse_output_limit_closes"] == 1
    # MGET and HGETALL check as they read: refused with an error, the connection kept.
    with pytest.raises(redis.ResponseError, match="exceeds the client output limit"):
        client.mget(["k"] * 2)
    assert client.strlen("k") == 600_000
    client.close()


def test_a_bad_config_file_is_refused_at_start(tmp_path):
    for text, words in [
        ("prot = 7000\n", "config file"),
        ('durability = "sometimes"\n', "durability"),
        ("proto_max_bulk_len = 0\n", "proto_max_bulk_len"),
        ("maxclients = 0\n", "maxclients"),
    ]:
        config = write_config(tmp_path, text)
        result = subprocess.run(
            [str(COPSE_BIN), "--path", str(tmp_path / "data"), "serve", "--port", "0", "--config", config],
            capture_output=True, text=True, timeout=15,
        )
        assert result.returncode == 3, (text, result.returncode, result.stderr)
        assert words in result.stderr, (text, result.stderr)


def test_metrics_endpoint(make_server):
    port = free_port()
    server = make_server("--metrics-port", str(port))
    client = server.client()
    client.set("m", 1)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        data = recv_all_until_close(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK"), head
    assert b"Content-Type: text/plain" in head
    length = int([line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")][0].split(b":")[1])
    assert length == len(body)
    text = body.decode()
    assert "copse_connected_clients" in text
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value)  # every sample is a number
    client.close()


def test_client_reply_kill_pause_and_the_switches_libraries_send(server):
    """CLIENT REPLY OFF/ON/SKIP, KILL by id, NO-EVICT, NO-TOUCH, PAUSE WRITE/ALL and UNPAUSE, and
    TRACKING refused with a clear error (issue 24 item 5)."""
    import threading

    from support import encode_command

    sock = server.connect()
    sock.sendall(b"".join(encode_command(*c) for c in (
        ("CLIENT", "REPLY", "OFF"), ("SET", "quiet", "1"), ("CLIENT", "REPLY", "ON"), ("GET", "quiet"),
        ("CLIENT", "REPLY", "SKIP"), ("GET", "quiet"), ("PING",))))
    data = b""
    sock.settimeout(5)
    while not data.endswith(b"+PONG\r\n"):
        data += sock.recv(1000)
    assert data == b"+OK\r\n$1\r\n1\r\n+PONG\r\n"
    sock.close()
    r = server.client()
    victim = server.connect()
    victim.sendall(encode_command("CLIENT", "ID"))
    victim_id = int(victim.recv(100)[1:-2])
    assert r.execute_command("CLIENT", "KILL", "ID", str(victim_id)) == 1
    victim.settimeout(5)
    assert victim.recv(100) == b"", "the killed client's connection is still open"
    assert r.execute_command("CLIENT", "KILL", "ID", "999999") == 0
    assert r.execute_command("CLIENT", "NO-EVICT", "on") in (b"OK", True)
    assert r.execute_command("CLIENT", "NO-TOUCH", "on") in (b"OK", True)
    with pytest.raises(redis.ResponseError, match="client-side caching"):
        r.execute_command("CLIENT", "TRACKING", "on")
    other = server.client()
    r.execute_command("CLIENT", "PAUSE", "300", "WRITE")
    started = time.time()
    other.set("paused", 1)
    assert time.time() - started >= 0.25, "a write ran during CLIENT PAUSE WRITE"
    r.execute_command("CLIENT", "PAUSE", "10000")
    threading.Timer(0.3, lambda: server.client().execute_command("CLIENT", "UNPAUSE")).start()
    started = time.time()
    assert other.get("paused") == b"1"
    assert 0.25 <= time.time() - started < 5, "CLIENT UNPAUSE did not release the pause"
