"""Commands over keys of any type and over the key space: DEL, UNLINK, EXISTS, TYPE, SCAN,
KEYS, DBSIZE, FLUSHALL, FLUSHDB."""

from __future__ import annotations

import threading

import pytest
import redis

from support import raw_command


def test_del_and_unlink(rc):
    rc.mset({"a": "1", "b": "2", "c": "3", "d": "4"})
    assert rc.delete("a", "b", "missing") == 2
    assert rc.exists("a", "b") == 0
    assert rc.delete("c", "c", "c") == 1, "a key named twice is deleted once"
    assert rc.unlink("d", "missing") == 1
    assert rc.unlink("d") == 0
    assert rc.delete("missing") == 0
    assert rc.dbsize() == 0
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'del' command"):
        rc.execute_command("DEL")


def test_del_is_seen_at_once_by_another_connection(server, r):
    other = server.client()
    for i in range(100):
        r.set(f"gone:{i}", "x")
        assert r.delete(f"gone:{i}") == 1
        assert other.get(f"gone:{i}") is None
    other.close()


def test_del_of_fifty_thousand_keys(r):
    keys = [f"d:{i}" for i in range(50_000)]
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.set(key, "1")
    pipe.execute()
    assert r.dbsize() == 50_000
    assert r.unlink(*keys) == 50_000
    assert r.dbsize() == 0


def test_exists_counts_repeated_keys_each_time(rc):
    rc.set("a", "1")
    rc.set("b", "")
    assert rc.exists("a") == 1
    assert rc.exists("missing") == 0
    assert rc.exists("a", "a", "a") == 3
    assert rc.exists("a", "b", "missing", "a") == 3
    keys = [f"e:{i}" for i in range(50)]
    rc.mset({key: "x" for key in keys})
    assert rc.exists(*keys, *keys, "nope") == 100


def test_type(rc):
    rc.set("s", "v")
    assert rc.type("s") == b"string"
    assert rc.type("missing") == b"none"
    rc.incr("n")
    assert rc.type("n") == b"string"


def test_type_and_del_of_a_hash(r, hash_key):
    hash_key("h", {f"f{i}": str(i) for i in range(20)})
    assert r.type("h") == b"hash"
    assert r.exists("h", "h") == 2
    assert r.dbsize() == 1, "a hash is one key, however many fields"
    assert r.delete("h") == 1
    assert r.type("h") == b"none"
    assert r.dbsize() == 0
    assert r.execute_command("HGETALL", "h") in ({}, [])


def test_dbsize(rc):
    assert rc.dbsize() == 0
    rc.mset({f"k{i}": i for i in range(123)})
    assert rc.dbsize() == 123
    rc.delete("k0")
    assert rc.dbsize() == 122


@pytest.mark.parametrize("command", ["FLUSHALL", "FLUSHDB"])
def test_flushall_and_flushdb(rc, command):
    rc.mset({f"k{i}": i for i in range(2500)})
    assert rc.dbsize() == 2500
    assert rc.execute_command(command) in (True, b"OK", "OK")
    assert rc.dbsize() == 0
    assert rc.get("k1") is None
    rc.set("after", "1")
    for mode in ("ASYNC", "SYNC", "async"):
        assert rc.execute_command(command, mode) in (True, b"OK", "OK")
        assert rc.dbsize() == 0
    with pytest.raises(redis.ResponseError, match="syntax error"):
        rc.execute_command(command, "LATER")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        rc.execute_command(command, "ASYNC", "SYNC")


def test_flushall_sees_the_writes_before_it_in_a_pipeline(r):
    pipe = r.pipeline(transaction=False)
    for i in range(500):
        pipe.set(f"k{i}", i)
    pipe.flushall()
    pipe.set("survivor", 1)
    pipe.dbsize()
    replies = pipe.execute()
    assert replies[-1] == 1
    assert r.keys("*") == [b"survivor"]


# -- KEYS --------------------------------------------------------------------------------------


GLOB_KEYS = ["hello", "hallo", "hxllo", "hllo", "heeeello", "h*llo", "user:1:name", "user:2:mail", "x"]


@pytest.mark.parametrize(
    "pattern,expected",
    [
        ("*", GLOB_KEYS),
        ("h?llo", ["hello", "hallo", "hxllo", "h*llo"]),
        ("h*llo", ["hello", "hallo", "hxllo", "hllo", "heeeello", "h*llo"]),
        ("h[ae]llo", ["hello", "hallo"]),
        ("h[^e]llo", ["hallo", "hxllo", "h*llo"]),
        ("h[a-b]llo", ["hallo"]),
        ("h\\*llo", ["h*llo"]),
        ("user:*:name", ["user:1:name"]),
        ("user:?:*", ["user:1:name", "user:2:mail"]),
        ("nothing*", []),
        ("x", ["x"]),
    ],
)
def test_keys_glob_patterns(r, pattern, expected):
    r.mset({key: "1" for key in GLOB_KEYS})
    assert sorted(r.keys(pattern)) == sorted(key.encode() for key in expected)


def test_keys_in_resp3_and_on_an_empty_store(server):
    client = server.client(protocol=3)
    client.flushall()
    assert client.keys("*") == []
    client.mset({"a1": 1, "a2": 2, "b1": 3})
    assert sorted(client.keys("a*")) == [b"a1", b"a2"]
    client.close()


def test_keys_over_many_keys(r):
    pipe = r.pipeline(transaction=False)
    for i in range(5000):
        pipe.set(f"many:{i}", "x")
        if i % 10 == 0:
            pipe.set(f"tenth:{i}", "x")
    pipe.execute()
    assert len(r.keys("many:*")) == 5000
    assert len(r.keys("tenth:*")) == 500
    assert len(r.keys("*")) == 5500


# -- SCAN --------------------------------------------------------------------------------------


def fill(client, count=2000, prefix="scan"):
    keys = {f"{prefix}:{i}".encode() for i in range(count)}
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.set(key, "v")
    pipe.execute()
    return keys


def scan_all(client, **options):
    """Iterates SCAN to completion by hand; returns (every key seen, with repeats; calls)."""
    cursor, seen, calls = 0, [], 0
    while True:
        cursor, keys = client.scan(cursor=cursor, **options)
        assert isinstance(cursor, int), f"cursor {cursor!r} must be an integer"
        seen.extend(keys)
        calls += 1
        assert calls < 100_000, "SCAN does not terminate"
        if cursor == 0:
            return seen, calls


@pytest.mark.parametrize("count", [None, 1, 7, 100, 5000])
def test_scan_iterates_over_every_key(rc, count):
    keys = fill(rc)
    options = {} if count is None else {"count": count}
    seen, calls = scan_all(rc, **options)
    assert set(seen) == keys, f"missing: {sorted(keys - set(seen))[:5]}, extra: {sorted(set(seen) - keys)[:5]}"
    if count is not None and count < 2000:
        assert calls >= 2000 // count, "COUNT bounds the keys of one call"


def test_scan_replies_with_a_decimal_cursor(rc):
    fill(rc, 50)
    reply = raw_command(rc, "SCAN", "0", "COUNT", "10")
    assert isinstance(reply, list) and len(reply) == 2
    cursor, keys = reply
    assert isinstance(cursor, bytes) and cursor.isdigit() and cursor != b"0", cursor
    assert isinstance(keys, list) and 1 <= len(keys) <= 10
    # The last page answers cursor "0".
    while cursor != b"0":
        cursor, keys = raw_command(rc, "SCAN", cursor, "COUNT", "1000")
    assert cursor == b"0"


def test_scan_match(rc):
    fill(rc, 2000)
    wanted = {f"scan:{i}".encode() for i in range(2000) if str(i).endswith("7")}
    seen, _ = scan_all(rc, match="scan:*7", count=50)
    assert set(seen) == wanted
    assert set(rc.scan_iter(match="scan:1?", count=10)) == {f"scan:{i}".encode() for i in range(10, 20)}
    assert list(rc.scan_iter(match="nothing:*")) == []


def test_scan_type(rc):
    keys = fill(rc, 2000)
    seen, _ = scan_all(rc, _type="string", count=100)
    assert set(seen) == keys
    seen, _ = scan_all(rc, _type="hash", count=100)
    assert seen == []
    seen, _ = scan_all(rc, _type="STRING", match="scan:19*", count=100)
    assert set(seen) == {key for key in keys if key.startswith(b"scan:19")}


def test_scan_type_with_hashes(r, hash_key):
    strings = fill(r, 500)
    hashes = {f"hash:{i}".encode() for i in range(50)}
    for key in hashes:
        hash_key(key)
    assert set(scan_all(r, _type="hash", count=30)[0]) == hashes
    assert set(scan_all(r, _type="string", count=30)[0]) == strings
    assert set(scan_all(r, count=30)[0]) == strings | hashes


def test_scan_while_keys_change(server, r):
    """Keys present for the whole iteration are returned at least once, whatever is written
    meanwhile."""
    stable = fill(r, 2000, prefix="stable")
    stop = threading.Event()
    errors = []

    def churn():
        client = server.client()
        i = 0
        try:
            while not stop.is_set():
                pipe = client.pipeline(transaction=False)
                for j in range(50):
                    pipe.set(f"churn:{i + j}", "x")
                    if i + j >= 200:
                        pipe.delete(f"churn:{i + j - 200}")
                pipe.execute()
                i += 50
        except Exception as err:
            errors.append(err)
        finally:
            client.close()

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        seen, _ = scan_all(r, count=20)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors
    assert stable <= set(seen), f"missing {len(stable - set(seen))} stable keys"


def test_scan_errors(rc):
    with pytest.raises(redis.ResponseError, match="invalid cursor"):
        rc.execute_command("SCAN", "abc")
    with pytest.raises(redis.ResponseError, match="invalid cursor"):
        rc.execute_command("SCAN", "-1")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        rc.execute_command("SCAN", "0", "MATCH")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        rc.execute_command("SCAN", "0", "COUNT", "0")
    with pytest.raises(redis.ResponseError, match="not an integer"):
        rc.execute_command("SCAN", "0", "COUNT", "many")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        rc.execute_command("SCAN", "0", "BOGUS", "1")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'scan' command"):
        rc.execute_command("SCAN")


def test_scan_on_an_empty_store(rc):
    assert rc.scan(0) == (0, [])
    assert rc.scan(0, count=1000, match="*") == (0, [])


# -- expiry (test_expiry.py compares every reply with redis-server's) ----------------------------


def require_command(client, name):
    """Fails (it used to skip) when the server lost a command these tests cover."""
    names = {n.decode().lower() for n in raw_command(client, "COMMAND", "LIST")}
    assert name in names, f"{name.upper()} is missing from COMMAND LIST"


@pytest.mark.parametrize(
    "command, ttl_s",
    [
        (("EXPIRE", "k", "100"), 100),
        (("PEXPIRE", "k", "100000"), 100),
        (("EXPIREAT", "k", "4102444800"), None),
        (("PEXPIREAT", "k", "4102444800000"), None),
        (("EXPIRE", "k", "100", "NX"), 100),
    ],
)
def test_expire_family_sets_a_deadline(rc, command, ttl_s):
    require_command(rc, command[0].lower())
    rc.set("k", "v")
    assert rc.execute_command(*command) == 1
    assert rc.get("k") == b"v"
    if ttl_s is None:
        assert rc.expiretime("k") == 4102444800
    else:
        assert rc.ttl("k") == ttl_s
    assert rc.execute_command(command[0], "missing", *command[2:]) == 0


@pytest.mark.parametrize("command", [("SETEX", "k", "100", "v"), ("PSETEX", "k", "100000", "v")])
def test_setex_sets_a_value_and_its_deadline(rc, command):
    require_command(rc, command[0].lower())
    assert rc.execute_command(*command) in (b"OK", "OK", True)
    assert rc.get("k") == b"v" and rc.ttl("k") == 100


def test_ttl_pttl_persist(rc):
    require_command(rc, "ttl")
    rc.set("k", "v")
    assert rc.ttl("k") == -1
    assert rc.pttl("k") == -1
    assert rc.ttl("missing") == -2
    assert rc.pttl("missing") == -2
    assert rc.persist("k") is False
    assert rc.persist("missing") is False
