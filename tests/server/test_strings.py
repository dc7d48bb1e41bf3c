"""String commands of `copse serve`, through redis-py in RESP2 and RESP3 (`rc` runs a test in
both; `r` is RESP2 only, for tests whose replies do not depend on the protocol)."""

from __future__ import annotations


import pytest
import redis

from support import encode_command, raw_command, recv_all_until_close, run_clients

VALUE_BYTES_MAX = 16 * 1024 * 1024
REDIS_KEY_BYTES_MAX = 1 << 20  # keyspace::REDIS_KEY_BYTES_MAX
MiB = 1024 * 1024


# -- GET / SET and its options -----------------------------------------------------------------


def test_get_set_and_missing_key(rc):
    assert rc.get("missing") is None
    assert rc.set("k", "v") is True
    assert rc.get("k") == b"v"
    assert rc.set("k", "") is True
    assert rc.get("k") == b"", "an empty value is a value, not a missing key"
    assert rc.exists("k") == 1


def test_set_replaces_a_hash_or_sorted_set_whatever_else_the_store_holds(r):
    """A plain SET looks the key's type up only while its shard may hold a hash or sorted set
    (some key starts with a field or member tag); in a store of strings alone it writes with no
    lookup. Either way the key ends a string, listed once, with nothing of its old value left."""
    assert r.set("s", "1") and r.set("s", "2")
    assert r.hset("h", "f", "v") == 1
    assert r.set("h", "x") and r.type("h") == b"string" and r.get("h") == b"x"
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        r.hget("h", "f")
    assert r.zadd("z", {"m": 1}) == 1
    assert r.set("z", "y") and r.type("z") == b"string"
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        r.zscore("z", "m")
    # Emptied collections are gone, so the store again holds only strings.
    assert r.hset("g", "f", "v") == 1 and r.hdel("g", "f") == 1 and r.exists("g") == 0
    assert r.zadd("o", {"m": 1}) == 1 and r.zrem("o", "m") == 1 and r.exists("o") == 0
    for key in ("g", "o", "s"):
        assert r.set(key, "v") and r.type(key) == b"string"
    assert sorted(r.keys("*")) == [b"g", b"h", b"o", b"s", b"z"]
    assert r.dbsize() == 5


def test_set_nx_and_xx(rc):
    assert rc.set("k", "v1", xx=True) is None
    assert rc.exists("k") == 0, "SET XX must not create the key"
    assert rc.set("k", "v1", nx=True) is True
    assert rc.set("k", "v2", nx=True) is None
    assert rc.get("k") == b"v1", "SET NX must not overwrite"
    assert rc.set("k", "v3", xx=True) is True
    assert rc.get("k") == b"v3"
    with pytest.raises(redis.ResponseError, match="syntax error"):
        rc.execute_command("SET", "k", "v", "NX", "XX")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        rc.execute_command("SET", "k", "v", "XX", "NX")
    assert rc.get("k") == b"v3"


def test_set_get_returns_the_old_value(rc):
    assert rc.set("k", "v1", get=True) is None
    assert rc.get("k") == b"v1", "SET GET on a missing key still sets it"
    assert rc.set("k", "v2", get=True) == b"v1"
    assert rc.get("k") == b"v2"
    # NX with GET: answers the old value and does not set.
    assert rc.set("k", "v3", nx=True, get=True) == b"v2"
    assert rc.get("k") == b"v2"
    assert rc.set("other", "x", xx=True, get=True) is None
    assert rc.exists("other") == 0


def test_set_keepttl_keeps_the_deadline(rc):
    assert rc.set("k", "v1", ex=100) is True
    assert rc.set("k", "v2", keepttl=True) is True
    assert rc.get("k") == b"v2" and rc.ttl("k") == 100
    assert rc.set("k", "v3") is True
    assert rc.ttl("k") == -1, "a plain SET removes the deadline"


@pytest.mark.parametrize("option", [("EX", "100"), ("PX", "100000"), ("EXAT", "4102444800"), ("PXAT", "4102444800000")])
def test_set_with_expiry_sets_a_deadline(rc, option):
    assert rc.execute_command("SET", "k", "v", *option) in (b"OK", "OK", True)
    assert rc.get("k") == b"v"
    if option[0] in ("EX", "PX"):
        assert rc.ttl("k") == 100
    else:
        assert rc.expiretime("k") == 4102444800
    # redis-py's own ex=/px= arguments reach the same option.
    assert rc.set("k2", "v", px=100_000) is True and rc.ttl("k2") == 100


def test_set_syntax_errors(rc):
    with pytest.raises(redis.ResponseError, match="syntax error"):
        rc.execute_command("SET", "k", "v", "BOGUS")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'set' command"):
        rc.execute_command("SET", "k")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'get' command"):
        rc.execute_command("GET", "a", "b")
    assert rc.exists("k") == 0


def test_setnx(rc):
    assert rc.setnx("k", "v1") is True
    assert rc.setnx("k", "v2") is False
    assert rc.get("k") == b"v1"


def test_getset(rc):
    assert rc.getset("k", "v1") is None
    assert rc.getset("k", "v2") == b"v1"
    assert rc.get("k") == b"v2"


def test_getdel(rc):
    assert rc.getdel("missing") is None
    rc.set("k", "v")
    assert rc.getdel("k") == b"v"
    assert rc.exists("k") == 0
    assert rc.getdel("k") is None


# -- multi-key ---------------------------------------------------------------------------------


def test_mset_and_mget_across_shards(rc):
    pairs = {f"key:{i}": f"value:{i}" for i in range(100)}
    assert rc.mset(pairs) is True
    keys = list(pairs) + ["missing:1"]
    assert rc.mget(keys) == [v.encode() for v in pairs.values()] + [None]
    # A key named twice: the last value wins, and MGET answers it twice.
    assert rc.execute_command("MSET", "dup", "a", "dup", "b") in (True, b"OK", "OK")
    assert rc.mget("dup", "dup", "missing") == [b"b", b"b", None]
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'mset' command"):
        rc.execute_command("MSET", "a", "1", "b")
    assert rc.exists("b") == 0


def test_msetnx(rc):
    assert rc.msetnx({"a": "1", "b": "2", "c": "3"}) is True
    assert rc.mget("a", "b", "c") == [b"1", b"2", b"3"]
    # One existing key: nothing is set.
    assert rc.msetnx({"d": "4", "a": "x", "e": "5"}) is False
    assert rc.mget("a", "d", "e") == [b"1", None, None]
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'msetnx' command"):
        rc.execute_command("MSETNX", "x", "1", "y")


# -- lengths, ranges, appends ------------------------------------------------------------------


def test_strlen_and_append(rc):
    assert rc.strlen("k") == 0
    assert rc.append("k", "bar") == 3
    assert rc.get("k") == b"bar"
    assert rc.append("k", "100") == 6
    assert rc.get("k") == b"bar100"
    assert rc.strlen("k") == 6
    rc.set("n", 1)
    assert rc.append("n", 2) == 2
    assert rc.get("n") == b"12"


def test_append_beyond_the_value_limit_is_refused(r):
    r.set("big", b"x" * (VALUE_BYTES_MAX - 1000))
    with pytest.raises(redis.ResponseError, match="string exceeds maximum allowed size"):
        r.append("big", b"y" * 1001)
    assert r.strlen("big") == VALUE_BYTES_MAX - 1000


@pytest.mark.parametrize(
    "start,end,expected",
    [
        (0, 3, b"Hell"),
        (0, -1, b"Hello World"),
        (-4, -1, b"orld"),
        (5, 3, b""),
        (5, 5000, b" World"),
        (-5000, 10000, b"Hello World"),
        (6, 6, b"W"),
        (0, 4294967297, b"Hello World"),
    ],
)
def test_getrange(r, start, end, expected):
    r.set("k", "Hello World")
    assert r.getrange("k", start, end) == expected


def test_getrange_edge_cases(rc):
    assert rc.getrange("missing", 0, -1) == b""
    rc.set("n", 1234)
    assert rc.getrange("n", 0, 2) == b"123"
    assert rc.getrange("n", -2, -1) == b"34"
    with pytest.raises(redis.ResponseError, match="not an integer"):
        rc.execute_command("GETRANGE", "n", "a", "1")


def test_setrange(rc):
    assert rc.setrange("k", 0, "foo") == 3
    assert rc.get("k") == b"foo"
    assert rc.setrange("k", 0, "b") == 3
    assert rc.get("k") == b"boo"
    assert rc.setrange("k", 1, "b") == 3
    assert rc.get("k") == b"bbo"
    assert rc.setrange("k", 0, "") == 3
    assert rc.get("k") == b"bbo"
    # Past the end: the gap is filled with zero bytes.
    assert rc.setrange("k", 5, "bar") == 8
    assert rc.get("k") == b"bbo\x00\x00bar"


def test_setrange_on_a_missing_key(rc):
    assert rc.setrange("pad", 4, "x") == 5
    assert rc.get("pad") == b"\x00\x00\x00\x00x"
    assert rc.setrange("empty", 3, "") == 0
    assert rc.exists("empty") == 0, "SETRANGE with an empty patch creates no key"
    assert rc.setrange("zero", 0, "") == 0
    assert rc.exists("zero") == 0


def test_setrange_errors(rc):
    rc.set("k", "foo")
    with pytest.raises(redis.ResponseError, match="offset is out of range"):
        rc.setrange("k", -1, "x")
    with pytest.raises(redis.ResponseError, match="not an integer"):
        rc.execute_command("SETRANGE", "k", "one", "x")
    with pytest.raises(redis.ResponseError, match="string exceeds maximum allowed size"):
        rc.setrange("k", VALUE_BYTES_MAX, "x")
    with pytest.raises(redis.ResponseError, match="string exceeds maximum allowed size"):
        rc.setrange("k", 9223372036854775807, "x")
    assert rc.get("k") == b"foo"


def test_setrange_up_to_the_value_limit(r):
    assert r.setrange("edge", VALUE_BYTES_MAX - 1, "z") == VALUE_BYTES_MAX
    assert r.getrange("edge", -2, -1) == b"\x00z"


# -- counters ----------------------------------------------------------------------------------


def test_incr_decr_family(rc):
    assert rc.incr("n") == 1
    assert rc.get("n") == b"1"
    assert rc.incr("n") == 2
    assert rc.decr("n") == 1
    assert rc.incrby("n", 10) == 11
    assert rc.decrby("n", 20) == -9
    assert rc.get("n") == b"-9"
    assert rc.decr("fresh") == -1
    rc.set("big", 17179869184)
    assert rc.incr("big") == 17179869185
    assert rc.incrby("big", 17179869184) == 34359738369
    rc.set("set", 100)
    assert rc.incr("set") == 101


@pytest.mark.parametrize("stored", [" 11", "11 ", " 11 ", "abc", "1.5", "", "01", "+1", "99999999999999999999"])
def test_incr_refuses_values_that_are_not_integers(rc, stored):
    rc.set("n", stored)
    with pytest.raises(redis.ResponseError, match="value is not an integer or out of range"):
        rc.incr("n")
    assert rc.get("n") == stored.encode(), "a failed INCR changes nothing"


def test_incr_overflow(rc):
    rc.set("n", 9223372036854775807)
    with pytest.raises(redis.ResponseError, match="increment or decrement would overflow"):
        rc.incr("n")
    rc.set("m", -9223372036854775808)
    with pytest.raises(redis.ResponseError, match="increment or decrement would overflow"):
        rc.decr("m")
    with pytest.raises(redis.ResponseError, match="increment or decrement would overflow"):
        rc.incrby("m", -1)
    assert rc.get("n") == b"9223372036854775807"
    assert rc.get("m") == b"-9223372036854775808"
    rc.set("z", 0)
    with pytest.raises(redis.ResponseError):
        rc.decrby("z", -9223372036854775808)
    assert rc.get("z") == b"0"
    with pytest.raises(redis.ResponseError, match="value is not an integer or out of range"):
        rc.execute_command("INCRBY", "z", "1.5")
    with pytest.raises(redis.ResponseError, match="value is not an integer or out of range"):
        rc.execute_command("INCRBY", "z", "9223372036854775808")


def test_incrbyfloat_formats_as_redis(r):
    def incrbyfloat(key, by):
        return raw_command(r, "INCRBYFLOAT", key, by)

    assert incrbyfloat("f", "10.5") == b"10.5"
    assert r.get("f") == b"10.5"
    assert incrbyfloat("f", "0.1") == b"10.6"
    assert incrbyfloat("f", "-5") == b"5.6"
    r.set("e", "5.0e3")
    assert incrbyfloat("e", "2.0e2") == b"5200"
    assert incrbyfloat("novar", "1") == b"1"
    assert incrbyfloat("novar", "0.25") == b"1.25"
    r.set("big", 17179869184)
    assert incrbyfloat("big", "1.5") == b"17179869185.5"
    r.set("i", 3)
    assert incrbyfloat("i", "-3") == b"0", "never '-0' or '0.0'"
    # redis-py's own method parses the bulk reply to a float.
    assert r.incrbyfloat("i", 1.5) == 1.5


@pytest.mark.xfail(
    strict=True,
    reason="deviation: copse adds in f64 and prints the shortest round-trip form; Redis adds in "
    "long double and prints %.17Lf trimmed (0.1+0.2 is '0.3', 1e20+1 is '100000000000000000001')",
)
def test_incrbyfloat_prints_as_redis_long_double_does(r):
    r.set("a", "0.1")
    assert raw_command(r, "INCRBYFLOAT", "a", "0.2") == b"0.3"
    r.set("b", "1e20")
    assert raw_command(r, "INCRBYFLOAT", "b", "1") == b"100000000000000000001"


def test_incrbyfloat_errors(r):
    r.set("f", "1.7e308")
    with pytest.raises(redis.ResponseError, match="increment would produce NaN or Infinity"):
        r.incrbyfloat("f", "1.7e308")
    assert r.get("f") == b"1.7e308"
    r.set("z", 0)
    with pytest.raises(redis.ResponseError, match="increment would produce NaN or Infinity"):
        r.execute_command("INCRBYFLOAT", "z", "+inf")
    r.set("s", "abc")
    with pytest.raises(redis.ResponseError, match="value is not a valid float"):
        r.incrbyfloat("s", 1)
    r.set("sp", " 11")
    with pytest.raises(redis.ResponseError, match="value is not a valid float"):
        r.incrbyfloat("sp", 1)
    with pytest.raises(redis.ResponseError, match="value is not a valid float"):
        r.execute_command("INCRBYFLOAT", "z", "one")
    with pytest.raises(redis.ResponseError, match="value is not a valid float"):
        r.execute_command("INCRBYFLOAT", "z", "nan")
    assert r.get("z") == b"0"
    assert r.get("s") == b"abc"


# -- binary safety, sizes, key limits ----------------------------------------------------------


def test_binary_safe_keys_and_values(rc):
    every_byte = bytes(range(256))
    rc.set(every_byte, every_byte)
    assert rc.get(every_byte) == every_byte
    for b in range(256):
        key = b"byte:" + bytes([b])
        rc.set(key, bytes([b]) * 3)
    assert rc.mget([b"byte:" + bytes([b]) for b in range(256)]) == [bytes([b]) * 3 for b in range(256)]
    crlf = b"a\r\nb\r\n\x00\r\n"
    rc.set(crlf, crlf + crlf)
    assert rc.get(crlf) == crlf + crlf
    assert rc.strlen(crlf) == 2 * len(crlf)
    assert rc.append(every_byte, b"\x00") == 257
    assert rc.get(every_byte) == every_byte + b"\x00"
    assert set(rc.keys(b"byte:*")) == {b"byte:" + bytes([b]) for b in range(256)}


def test_large_values(r):
    value = bytes(range(256)) * (MiB // 256)
    r.set("mib", value)
    assert r.get("mib") == value
    assert r.strlen("mib") == MiB
    assert r.getrange("mib", MiB - 3, -1) == value[-3:]


def test_value_of_exactly_the_limit_is_accepted(r):
    value = b"v" * (VALUE_BYTES_MAX - 1) + b"!"
    assert r.set("max", value) is True
    assert r.strlen("max") == VALUE_BYTES_MAX
    assert r.get("max") == value


def test_mset_of_parts_larger_than_one_batch_record_is_atomic(r):
    """Eight 9 MiB values over four shards: at least two share a shard, 18 MiB in one part,
    more than one batch record holds (16 MiB): the part is a chain of records (before chains,
    this was refused)."""
    r.set("large:0", "before")
    values = {f"large:{i}": bytes([65 + i]) * (9 * MiB) for i in range(8)}
    assert r.mset(values) is True
    assert r.mget(list(values)) == list(values.values())
    r.delete(*values)


def test_mset_of_thirty_thousand_keys(r):
    pairs = {f"many:{i}": str(i) for i in range(30_000)}
    assert r.mset(pairs) is True
    assert r.dbsize() == 30_000
    assert r.mget(["many:0", "many:29999"]) == [b"0", b"29999"]


def test_mset_past_the_old_batch_limit_in_each_shard(r):
    """50,000 keys over four shards put over 10,000 keys in each part: the old limit of one
    batch (WRITE_BATCH_OPS_MAX was 10,000), refused before chains. test_large_writes.py has the
    large single-shard writes."""
    r.flushdb()
    pairs = {f"many:{i}": str(i) for i in range(50_000)}
    assert r.mset(pairs) is True
    assert r.dbsize() == 50_000
    assert r.delete(*pairs) == 50_000


def test_mget_never_sees_half_of_an_mset_across_shards(server, r):
    """A writer rewrites eight keys (over every shard) with MSET; readers' MGET of them always
    sees one MSET's values, never a mix."""
    import threading

    keys = [f"atomic:{i}" for i in range(8)]
    r.mset({key: "0" for key in keys})
    stop = threading.Event()
    failures = []

    def writer():
        client = server.client(protocol=2)
        n = 0
        while not stop.is_set():
            n += 1
            client.mset({key: str(n) for key in keys})
        client.close()

    def reader():
        client = server.client(protocol=2)
        reads = 0
        while not stop.is_set():
            values = client.mget(keys)
            reads += 1
            if len(set(values)) != 1:
                failures.append(values)
                break
        client.close()
        assert reads > 0

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    import time

    time.sleep(2)
    stop.set()
    for thread in threads:
        thread.join(30)
    assert not failures, f"MGET saw half an MSET: {failures[0]}"
    assert int(r.get(keys[0])) > 5, "the writer made too few MSETs to test anything"


def test_bulk_over_the_limit_is_a_protocol_error_and_closes(server, r):
    """proto-max-bulk-len defaults to copse's largest value (16 MiB), so a 16 MiB + 1 bulk is
    refused as soon as its header arrives: -ERR Protocol error, then the connection closes."""
    with server.connect() as sock:
        sock.sendall(encode_command("PING"))
        sock.sendall(b"*3\r\n$3\r\nSET\r\n$4\r\nhuge\r\n$%d\r\n" % (VALUE_BYTES_MAX + 1) + b"x" * 1000)
        data = recv_all_until_close(sock)
    assert data == b"+PONG\r\n-ERR Protocol error: invalid bulk length\r\n"
    # The whole value through redis-py: an error (the server closed the connection), no key.
    client = server.client()
    with pytest.raises((redis.ConnectionError, redis.ResponseError)):
        client.set("huge", b"x" * (VALUE_BYTES_MAX + 1))
    client.close()
    # Others keep working, and nothing was written.
    assert r.ping() is True
    assert r.exists("huge") == 0


def test_keys_up_to_the_key_limit(rc):
    longest = b"k" * REDIS_KEY_BYTES_MAX
    assert rc.set(longest, "v") is True
    assert rc.get(longest) == b"v"
    assert rc.exists(longest) == 1
    too_long = b"k" * (REDIS_KEY_BYTES_MAX + 1)
    with pytest.raises(redis.ResponseError, match="too long") as info:
        rc.set(too_long, "v")
    assert f"{REDIS_KEY_BYTES_MAX} bytes" in str(info.value)
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.incr(too_long)
    # A multi-key command with one long key does nothing at all.
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.mset({"ok": "1", too_long: "2"})
    assert rc.exists("ok") == 0
    assert rc.get(longest) == b"v"


# -- ordering, pipelining, concurrency ---------------------------------------------------------


def test_write_is_visible_at_once_on_another_connection(server, r):
    other = server.client()
    try:
        for i in range(200):
            r.set(f"seen:{i}", f"value:{i}")
            assert other.get(f"seen:{i}") == f"value:{i}".encode()
    finally:
        other.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_pipeline_of_ten_thousand_mixed_commands(server, protocol):
    client = server.client(protocol=protocol)
    client.flushall()
    pipe = client.pipeline(transaction=False)
    expected = []
    counter = 0
    for i in range(10_000):
        kind = i % 3
        if kind == 0:
            pipe.set(f"p:{i}", f"v:{i}")
            expected.append(True)
        elif kind == 1:
            pipe.incr("p:counter")
            counter += 1
            expected.append(counter)
        else:
            pipe.get(f"p:{i - 2}")
            expected.append(f"v:{i - 2}".encode())
    replies = pipe.execute()
    assert len(replies) == len(expected)
    for at, (got, want) in enumerate(zip(replies, expected)):
        assert got == want, f"reply {at}: {got!r} != {want!r}"
    # INCR of one key in one pipeline gives 1..n in order.
    pipe = client.pipeline(transaction=False)
    for _ in range(2000):
        pipe.incr("p:seq")
    assert pipe.execute() == list(range(1, 2001))
    client.close()


def test_concurrent_incr_is_atomic(server, r):
    threads_count, per_thread = 8, 500

    def work(client, _n):
        for _ in range(per_thread):
            client.incr("shared")

    run_clients(server, threads_count, work)
    assert r.get("shared") == str(threads_count * per_thread).encode()


def test_concurrent_append_loses_nothing(server, r):
    def work(client, n):
        pipe = client.pipeline(transaction=False)
        for _ in range(300):
            pipe.append("log", "abcd"[n])
        pipe.execute()

    run_clients(server, 4, work)
    value = r.get("log")
    assert len(value) == 1200
    assert all(value.count(c.encode()) == 300 for c in "abcd")


# -- wrong types (need HSET) -------------------------------------------------------------------


WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"


@pytest.mark.parametrize(
    "command",
    [
        ("GET", "h"),
        ("GETSET", "h", "v"),
        ("GETDEL", "h"),
        ("STRLEN", "h"),
        ("APPEND", "h", "x"),
        ("GETRANGE", "h", "0", "-1"),
        ("SETRANGE", "h", "0", "x"),
        ("INCR", "h"),
        ("DECR", "h"),
        ("INCRBY", "h", "2"),
        ("DECRBY", "h", "2"),
        ("INCRBYFLOAT", "h", "1.5"),
        ("SET", "h", "v", "GET"),
    ],
)
def test_string_commands_on_a_hash_answer_wrongtype(r, hash_key, command):
    hash_key("h")
    with pytest.raises(redis.ResponseError) as info:
        r.execute_command(*command)
    assert str(info.value) == WRONGTYPE
    assert r.type("h") == b"hash", f"{command[0]} must not change a key of another type"


def test_string_writes_over_a_hash(r, hash_key):
    hash_key("h", {"a": "1", "b": "2"})
    assert r.mget("h", "missing") == [None, None], "MGET answers nil for a key of another type"
    assert r.setnx("h", "v") is False
    assert r.set("h", "v", nx=True) is None
    assert r.msetnx({"h": "v", "new": "1"}) is False
    assert r.exists("new") == 0
    # A plain SET replaces the hash, fields and all.
    assert r.set("h", "string now") is True
    assert r.type("h") == b"string"
    assert r.get("h") == b"string now"
    hash_key("h2")
    assert r.mset({"h2": "s"}) is True
    assert r.type("h2") == b"string"
    assert r.dbsize() == 2
