"""Hash commands of `copse serve`, through redis-py in RESP2 and RESP3 (`rc` runs a test in both;
`r` is RESP2 only, for tests whose replies do not depend on the protocol).

Expectations follow Redis 7.2's documentation; copse's own limits (key + field length, bytes
per atomic batch) are in docs/server.md and docs/format/redis-keyspace.md.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from support import assert_store_checks, raw_command, run_clients

WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
KEY_AND_FIELD_BYTES_MAX = 1003  # item key 1024 - FIELD_OVERHEAD_BYTES 21
REDIS_KEY_BYTES_MAX = 1 << 20  # keyspace::REDIS_KEY_BYTES_MAX
VALUE_BYTES_MAX = 16 * 1024 * 1024
MiB = 1024 * 1024


def flat(mapping: dict) -> list:
    """HSET's arguments for `mapping`: field, value, field, value, ..."""
    out = []
    for field, value in mapping.items():
        out += [field, value]
    return out


def hset_many(client: redis.Redis, key, mapping: dict):
    return client.execute_command("HSET", key, *flat(mapping))


def hscan_all(client: redis.Redis, key, **options) -> tuple[list, int]:
    """Every (field, value) an HSCAN iteration returns (repeats kept) and the number of calls."""
    seen = []
    cursor, calls = 0, 0
    while True:
        cursor, page = client.hscan(key, cursor, **options)
        calls += 1
        seen.extend(page.items())
        if cursor == 0:
            return seen, calls
        assert calls < 100_000, "HSCAN never returned cursor 0"


# -- HSET / HMSET / HSETNX / HGET / HMGET ------------------------------------------------------


def test_hset_counts_new_fields(rc):
    assert rc.hset("h", "a", "1") == 1
    assert rc.hset("h", "a", "2") == 0, "overwriting a field adds none"
    assert rc.hget("h", "a") == b"2"
    assert rc.hset("h", mapping={"a": "3", "b": "4", "c": "5"}) == 2
    assert rc.hmget("h", "a", "b", "c") == [b"3", b"4", b"5"]
    # A field named twice in one HSET: counted once, the last value wins.
    assert rc.execute_command("HSET", "h", "d", "x", "d", "y") == 1
    assert rc.hget("h", "d") == b"y"
    assert rc.hlen("h") == 4
    assert rc.type("h") == b"hash"
    assert rc.exists("h") == 1


def test_hset_arity_errors(rc):
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'hset' command"):
        rc.execute_command("HSET", "h", "a")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'hset' command"):
        rc.execute_command("HSET", "h", "a", "1", "b")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'hmset' command"):
        rc.execute_command("HMSET", "h", "a", "1", "b")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'hsetnx' command"):
        rc.execute_command("HSETNX", "h", "a", "1", "b", "2")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'hget' command"):
        rc.execute_command("HGET", "h")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'hmget' command"):
        rc.execute_command("HMGET", "h")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'hdel' command"):
        rc.execute_command("HDEL", "h")
    assert rc.exists("h") == 0, "a refused HSET creates nothing"


def test_hmset(rc):
    assert rc.execute_command("HMSET", "h", "a", "1", "b", "2") in (True, b"OK", "OK")
    assert rc.execute_command("HMSET", "h", "a", "10", "c", "3") in (True, b"OK", "OK")
    assert rc.hgetall("h") == {b"a": b"10", b"b": b"2", b"c": b"3"}


def test_hsetnx(rc):
    assert rc.hsetnx("h", "a", "1") == 1
    assert rc.hsetnx("h", "a", "2") == 0
    assert rc.hget("h", "a") == b"1", "HSETNX must not overwrite"
    assert rc.hsetnx("h", "b", "2") == 1
    assert rc.hgetall("h") == {b"a": b"1", b"b": b"2"}


def test_hget_and_hmget_of_missing_keys_and_fields(rc):
    assert rc.hget("missing", "a") is None
    assert rc.hmget("missing", "a", "b") == [None, None]
    rc.hset("h", mapping={"a": "1", "b": ""})
    assert rc.hget("h", "zz") is None
    assert rc.hget("h", "b") == b"", "an empty value is a value"
    # Order of the arguments, repeats and missing fields kept.
    assert rc.hmget("h", "b", "x", "a", "a", "b") == [b"", None, b"1", b"1", b""]


# -- whole-hash reads --------------------------------------------------------------------------


def test_hgetall_hkeys_hvals(rc):
    assert rc.hgetall("missing") == {}
    assert rc.hkeys("missing") == []
    assert rc.hvals("missing") == []
    fields = {f"field:{i}".encode(): f"value:{i}".encode() for i in range(300)}
    hset_many(rc, "h", fields)
    assert rc.hgetall("h") == fields
    keys = rc.hkeys("h")
    assert sorted(keys) == sorted(fields) and len(keys) == 300
    assert sorted(rc.hvals("h")) == sorted(fields.values())
    # HKEYS and HVALS are in one order: the same as HGETALL's.
    assert dict(zip(keys, rc.hvals("h"))) == fields


def test_hgetall_is_a_map_in_resp3_and_a_flat_array_in_resp2(rc):
    rc.hset("h", mapping={"a": "1", "b": "2"})
    reply = raw_command(rc, "HGETALL", "h")
    if rc.protocol_version == 3:
        assert reply == {b"a": b"1", b"b": b"2"}
    else:
        assert isinstance(reply, list) and len(reply) == 4
        assert dict(zip(reply[::2], reply[1::2])) == {b"a": b"1", b"b": b"2"}
    empty = raw_command(rc, "HGETALL", "missing")
    assert empty == ({} if rc.protocol_version == 3 else [])


# -- HDEL, HEXISTS, HLEN, HSTRLEN --------------------------------------------------------------


def test_hdel_counts_and_the_key_goes_with_its_last_field(rc):
    assert rc.hdel("missing", "a") == 0
    rc.hset("h", mapping={"a": "1", "b": "2", "c": "3"})
    assert rc.hdel("h", "a", "x", "a") == 1, "a missing field or a repeat counts nothing"
    assert rc.hexists("h", "a") == 0
    assert rc.hlen("h") == 2
    assert rc.hdel("h", "zz") == 0
    assert rc.hdel("h", "b", "c") == 2
    assert rc.exists("h") == 0, "a hash goes with its last field"
    assert rc.type("h") == b"none"
    assert rc.hlen("h") == 0
    assert rc.hgetall("h") == {}
    assert rc.dbsize() == 0
    # And comes back fresh.
    assert rc.hset("h", "n", "1") == 1
    assert rc.hgetall("h") == {b"n": b"1"}


def test_hexists_hlen_hstrlen(rc):
    assert rc.hexists("missing", "a") is False
    assert rc.hlen("missing") == 0
    assert rc.hstrlen("missing", "a") == 0
    rc.hset("h", mapping={"a": "hello", "b": "", "n": 12345})
    assert rc.hexists("h", "a") is True
    assert rc.hexists("h", "nope") is False
    assert rc.hlen("h") == 3
    assert rc.hstrlen("h", "a") == 5
    assert rc.hstrlen("h", "b") == 0
    assert rc.hstrlen("h", "n") == 5
    assert rc.hstrlen("h", "nope") == 0


# -- HINCRBY / HINCRBYFLOAT --------------------------------------------------------------------


def test_hincrby(rc):
    assert rc.hincrby("h", "n", 5) == 5, "a missing key and field count from 0"
    assert rc.hincrby("h", "n", -7) == -2
    assert rc.hget("h", "n") == b"-2"
    rc.hset("h", "big", 17179869184)
    assert rc.hincrby("h", "big", 1) == 17179869185
    assert rc.hincrby("h", "other", 0) == 0
    assert rc.hget("h", "other") == b"0"


@pytest.mark.parametrize("stored", ["abc", "1.5", " 1", "1 ", "", "99999999999999999999"])
def test_hincrby_refuses_values_that_are_not_integers(rc, stored):
    rc.hset("h", "f", stored)
    with pytest.raises(redis.ResponseError, match="hash value is not an integer"):
        rc.hincrby("h", "f", 1)
    assert rc.hget("h", "f") == stored.encode(), "a failed HINCRBY changes nothing"


def test_hincrby_errors(rc):
    rc.hset("h", "max", 9223372036854775807)
    rc.hset("h", "min", -9223372036854775808)
    with pytest.raises(redis.ResponseError, match="increment or decrement would overflow"):
        rc.hincrby("h", "max", 1)
    with pytest.raises(redis.ResponseError, match="increment or decrement would overflow"):
        rc.hincrby("h", "min", -1)
    assert rc.hget("h", "max") == b"9223372036854775807"
    assert rc.hget("h", "min") == b"-9223372036854775808"
    for bad in ["1.5", "x", "9223372036854775808", ""]:
        with pytest.raises(redis.ResponseError, match="value is not an integer or out of range"):
            rc.execute_command("HINCRBY", "h", "new", bad)
    assert rc.hexists("h", "new") is False
    with pytest.raises(redis.ResponseError, match="value is not an integer or out of range"):
        rc.execute_command("HINCRBY", "fresh", "f", "one")
    assert rc.exists("fresh") == 0, "a refused HINCRBY creates no hash"


def test_hincrbyfloat_as_documented(r):
    # The example of Redis's HINCRBYFLOAT page.
    r.hset("mykey", "field", "10.50")
    assert raw_command(r, "HINCRBYFLOAT", "mykey", "field", "0.1") == b"10.6"
    assert raw_command(r, "HINCRBYFLOAT", "mykey", "field", "-5") == b"5.6"
    r.hset("mykey", "field", "5.0e3")
    assert raw_command(r, "HINCRBYFLOAT", "mykey", "field", "2.0e2") == b"5200"
    assert r.hget("mykey", "field") == b"5200"
    assert raw_command(r, "HINCRBYFLOAT", "new", "f", "1.25") == b"1.25"
    r.hset("mykey", "int", 3)
    assert raw_command(r, "HINCRBYFLOAT", "mykey", "int", "-3") == b"0"
    assert r.hincrbyfloat("mykey", "int", 2.5) == 2.5


def test_hincrbyfloat_reply_is_a_bulk_string_in_both_protocols(rc):
    assert raw_command(rc, "HINCRBYFLOAT", "h", "f", "1.5") == b"1.5"
    assert rc.hincrbyfloat("h", "f", 1) == 2.5


def test_hincrbyfloat_errors(r):
    r.hset("h", mapping={"s": "abc", "sp": " 1", "big": "1.7e308", "z": "0"})
    with pytest.raises(redis.ResponseError, match="hash value is not a float"):
        r.hincrbyfloat("h", "s", 1)
    with pytest.raises(redis.ResponseError, match="hash value is not a float"):
        r.hincrbyfloat("h", "sp", 1)
    # copse adds in f64, so this overflows to infinity and is refused (Redis adds in long double,
    # where 3.4e308 is still finite; both refuse a result that is infinite in their arithmetic).
    with pytest.raises(redis.ResponseError, match="increment would produce NaN or Infinity"):
        r.hincrbyfloat("h", "big", "1.7e308")
    for bad in ["one", "nan", ""]:
        with pytest.raises(redis.ResponseError, match="value is not a valid float"):
            r.execute_command("HINCRBYFLOAT", "h", "z", bad)
    for infinite in ["inf", "-inf", "+inf"]:
        with pytest.raises(redis.ResponseError, match="value is NaN or Infinity"):
            r.execute_command("HINCRBYFLOAT", "h", "z", infinite)
    assert r.hgetall("h") == {b"s": b"abc", b"sp": b" 1", b"big": b"1.7e308", b"z": b"0"}


# -- HSCAN -------------------------------------------------------------------------------------


def test_hscan_iterates_1500_fields_to_completion(r):
    fields = {f"field:{i}".encode(): f"v{i}".encode() for i in range(1500)}
    hset_many(r, "h", fields)
    seen, calls = hscan_all(r, "h", count=37)
    assert calls > 1500 // 37 / 2, "COUNT pages the hash"
    assert {f for f, _ in seen} == set(fields), "every field at least once"
    assert all(fields[f] == v for f, v in seen), "every field with its value"
    # COUNT bounds each page (copse pages by COUNT exactly; Redis treats it as a hint).
    cursor, page = r.hscan("h", 0, count=10)
    assert cursor != 0 and 1 <= len(page) <= 20


def test_hscan_with_match(r):
    fields = {f"field:{i}".encode(): str(i).encode() for i in range(1500)}
    hset_many(r, "h", fields)
    seen, _ = hscan_all(r, "h", match="field:1*", count=100)
    wanted = {f for f in fields if f.startswith(b"field:1")}
    assert len(wanted) == 1 + 10 + 100 + 500
    assert {f for f, _ in seen} == wanted
    seen, _ = hscan_all(r, "h", match="field:?7", count=1000)
    assert {f for f, _ in seen} == {f"field:{i}7".encode() for i in range(1, 10)}
    seen, _ = hscan_all(r, "h", match="nothing*", count=500)
    assert seen == []
    # The default COUNT also gets through.
    seen, _ = hscan_all(r, "h", match="*")
    assert {f for f, _ in seen} == set(fields)


def test_hscan_sees_fields_present_throughout_while_others_change(r):
    stable = {f"stable:{i}".encode(): b"s" for i in range(1500)}
    hset_many(r, "h", stable)
    seen = set()
    cursor, step = 0, 0
    while True:
        cursor, page = r.hscan("h", cursor, count=50)
        seen.update(page)
        step += 1
        # Fields come and go during the iteration.
        r.hset("h", f"churn:{step}", "c")
        if step > 2:
            r.hdel("h", f"churn:{step - 2}")
        if cursor == 0:
            break
    assert set(stable) <= seen, f"{len(set(stable) - seen)} stable fields never returned"


def test_hscan_small_and_missing_and_errors(rc):
    assert rc.hscan("missing", 0) == (0, {})
    rc.hset("h", mapping={"a": "1", "b": "2"})
    assert rc.hscan("h", 0, count=100) == (0, {b"a": b"1", b"b": b"2"})
    with pytest.raises(redis.ResponseError, match="invalid cursor"):
        rc.execute_command("HSCAN", "h", "abc")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        rc.execute_command("HSCAN", "h", "0", "COUNT", "0")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        rc.execute_command("HSCAN", "h", "0", "BOGUS", "1")
    with pytest.raises(redis.ResponseError, match="value is not an integer or out of range"):
        rc.execute_command("HSCAN", "h", "0", "COUNT", "many")


# -- binary safety and sizes -------------------------------------------------------------------


def test_binary_safe_fields_and_values(rc):
    every_byte = bytes(range(256))
    crlf = b"a\r\nb\r\n\x00\r\n"
    fields = {
        every_byte: every_byte[::-1],
        crlf: crlf * 2,
        b"": b"empty field name",
        b"\x00": b"",
        b"\xff\xfe": b"\x00\x00\x00",
        "ünï©ødé".encode(): "välüé".encode(),
    }
    for b in range(0, 256, 7):
        fields[b"byte:" + bytes([b])] = bytes([b]) * 3
    hset_many(rc, every_byte, fields)
    assert rc.hgetall(every_byte) == fields
    for field, value in fields.items():
        assert rc.hget(every_byte, field) == value
        assert rc.hexists(every_byte, field) is True
        assert rc.hstrlen(every_byte, field) == len(value)
    seen, _ = hscan_all(rc, every_byte, count=5)
    assert dict(seen) == fields
    seen, _ = hscan_all(rc, every_byte, match=b"byte:*", count=3)
    assert {f for f, _ in seen} == {f for f in fields if f.startswith(b"byte:")}
    assert rc.hdel(every_byte, crlf, b"") == 2
    assert rc.hlen(every_byte) == len(fields) - 2


def test_a_one_mib_field_value(r):
    value = bytes(range(256)) * (MiB // 256)
    assert r.hset("h", mapping={"big": value, "small": "s"}) == 2
    assert r.hget("h", "big") == value
    assert r.hstrlen("h", "big") == MiB
    assert r.hmget("h", "small", "big") == [b"s", value]
    assert r.hgetall("h") == {b"big": value, b"small": b"s"}
    assert sorted(r.hvals("h")) == sorted([value, b"s"])
    assert r.hscan("h", 0, count=10)[1] == {b"big": value, b"small": b"s"}
    # Replaced by a small value, then by another large one.
    assert r.hset("h", "big", "tiny") == 0
    assert r.hget("h", "big") == b"tiny"
    assert r.hset("h", "big", value[::-1]) == 0
    assert r.hget("h", "big") == value[::-1]


def test_one_hset_of_values_past_one_batch_record_is_one_atomic_write(r):
    """Two 9 MiB values in one HSET: more than one batch record holds (16 MiB), so the batch is
    recorded as a chain (before chains, this was refused)."""
    r.hset("h", "keep", "old")
    nine = b"n" * (9 * MiB)
    assert r.execute_command("HSET", "h", "a", nine, "b", nine[::-1], "keep", "new") == 2
    assert r.hgetall("h") == {b"a": nine, b"b": nine[::-1], b"keep": b"new"}
    assert r.execute_command("HSET", "fresh", "a", nine, "b", nine) == 2
    assert r.hstrlen("fresh", "b") == 9 * MiB
    r.delete("h", "fresh")


FIELD_VALUE_BYTES_MAX = VALUE_BYTES_MAX - 4096  # cmd::hashes::FIELD_VALUE_BYTES_MAX


def test_a_field_value_of_exactly_the_limit(r):
    """docs/server.md: a field value may be 16 MiB - 4 KiB (a new hash writes its first field and
    its meta item in one batch record). It must not matter whether the hash exists yet."""
    value = b"v" * (FIELD_VALUE_BYTES_MAX - 1) + b"!"
    r.hset("existing", "other", "x")
    assert r.hset("existing", "max", value) == 1
    assert r.hstrlen("existing", "max") == FIELD_VALUE_BYTES_MAX
    # A new hash: its first field and its meta item are written together.
    assert r.hset("new", "max", value) == 1
    assert r.hstrlen("new", "max") == FIELD_VALUE_BYTES_MAX
    assert r.hget("new", "max") == value
    with pytest.raises(redis.ResponseError, match="exceeds copse's limit"):
        r.hset("other", "max", value + b"x")
    assert r.exists("other") == 0


# -- limits ------------------------------------------------------------------------------------


def test_key_and_field_length_limit(rc):
    key = b"k" * 11
    longest = b"f" * (KEY_AND_FIELD_BYTES_MAX - len(key))
    assert rc.hset(key, longest, "v") == 1
    assert rc.hget(key, longest) == b"v"
    assert rc.hexists(key, longest) is True
    too_long = longest + b"f"
    with pytest.raises(redis.ResponseError, match="too long") as info:
        rc.hset(key, too_long, "v")
    assert str(KEY_AND_FIELD_BYTES_MAX) in str(info.value), "the error names the limit"
    # Refused whole: nothing of a multi-pair HSET is written.
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.hset(key, mapping={"ok": "1", too_long: "2"})
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.hsetnx(key, too_long, "v")
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.hincrby(key, too_long, 1)
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.hincrbyfloat(key, too_long, 1)
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.execute_command("HMSET", "other", "a", "1", b"f" * (KEY_AND_FIELD_BYTES_MAX - 4), "2")
    assert rc.hset("other", b"f" * (KEY_AND_FIELD_BYTES_MAX - 5), "v") == 1
    assert rc.delete("other") == 1
    assert rc.hgetall(key) == {longest: b"v"}
    assert rc.exists("other") == 0
    # Reads of a field that cannot exist just find nothing.
    assert rc.hget(key, too_long) is None
    assert rc.hexists(key, too_long) is False
    assert rc.hstrlen(key, too_long) == 0
    assert rc.hdel(key, too_long) == 0
    # The longer the key, the shorter the longest field.
    long_key = b"K" * 1000
    assert rc.hset(long_key, b"f" * (KEY_AND_FIELD_BYTES_MAX - 1000), "v") == 1
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.hset(long_key, b"f" * (KEY_AND_FIELD_BYTES_MAX - 999), "v")
    # Past 1013 bytes a key is stored under a 36-byte name: the budget of a 36-byte key.
    longer_key = b"K" * 5000
    assert rc.hset(longer_key, b"f" * (KEY_AND_FIELD_BYTES_MAX - 36), "v") == 1
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.hset(longer_key, b"f" * (KEY_AND_FIELD_BYTES_MAX - 35), "v")
    # A key past the Redis key limit is refused as for strings.
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.hset(b"K" * (REDIS_KEY_BYTES_MAX + 1), "f", "v")
    assert rc.dbsize() == 3


# -- types -------------------------------------------------------------------------------------


HASH_COMMANDS = [
    ("HSET", "k", "f", "v"),
    ("HMSET", "k", "f", "v"),
    ("HSETNX", "k", "f", "v"),
    ("HGET", "k", "f"),
    ("HMGET", "k", "f", "g"),
    ("HGETALL", "k"),
    ("HDEL", "k", "f"),
    ("HEXISTS", "k", "f"),
    ("HLEN", "k"),
    ("HKEYS", "k"),
    ("HVALS", "k"),
    ("HSTRLEN", "k", "f"),
    ("HINCRBY", "k", "f", "1"),
    ("HINCRBYFLOAT", "k", "f", "1.5"),
    ("HSCAN", "k", "0"),
]


@pytest.mark.parametrize("command", HASH_COMMANDS, ids=[c[0] for c in HASH_COMMANDS])
def test_hash_commands_on_a_string_or_zset_answer_wrongtype(r, command):
    r.set("k", "string")
    with pytest.raises(redis.ResponseError) as info:
        r.execute_command(*command)
    assert str(info.value) == WRONGTYPE
    assert r.get("k") == b"string", f"{command[0]} must not change a string"
    r.delete("k")
    r.zadd("k", {"m": 1})
    with pytest.raises(redis.ResponseError) as info:
        r.execute_command(*command)
    assert str(info.value) == WRONGTYPE
    assert r.type("k") == b"zset"
    assert r.zrange("k", 0, -1, withscores=True) == [(b"m", 1.0)]


def test_string_commands_on_a_hash_answer_wrongtype(rc):
    rc.hset("h", "f", "v")
    for command in [("GET", "h"), ("APPEND", "h", "x"), ("INCR", "h"), ("STRLEN", "h"),
                    ("ZADD", "h", "1", "m"), ("ZSCORE", "h", "m"), ("ZRANGE", "h", "0", "-1")]:
        with pytest.raises(redis.ResponseError) as info:
            rc.execute_command(*command)
        assert str(info.value) == WRONGTYPE, command
    assert rc.hgetall("h") == {b"f": b"v"}


def test_set_over_a_hash_replaces_it(rc):
    hset_many(rc, "h", {f"f{i}": i for i in range(100)})
    assert rc.set("h", "now a string") is True
    assert rc.type("h") == b"string"
    assert rc.get("h") == b"now a string"
    assert rc.dbsize() == 1
    # No field survives: a new hash under the same key starts empty.
    rc.delete("h")
    assert rc.hset("h", "fresh", "1") == 1
    assert rc.hlen("h") == 1
    assert rc.hgetall("h") == {b"fresh": b"1"}
    assert rc.hexists("h", "f0") is False


def test_set_over_a_hash_replaces_it_in_one_batch(r):
    """SET replaces a key of any type (Redis), deleting the hash's items in the same atomic batch
    as the new value, whatever its size: the largest value now shares a batch too (a chain)."""
    hset_many(r, "h", {f"f{i}": i for i in range(5)})
    value = b"s" * VALUE_BYTES_MAX
    assert r.set("h", value) is True
    assert r.type("h") == b"string"
    assert r.strlen("h") == len(value)
    r.delete("h")


def test_del_of_a_hash_with_5000_fields(r):
    hset_many(r, "h", {f"field:{i}": "x" * (i % 50) for i in range(5000)})
    assert r.hlen("h") == 5000
    assert r.delete("h") == 1
    assert r.hlen("h") == 0
    assert r.exists("h") == 0
    assert r.type("h") == b"none"
    assert r.hgetall("h") == {}
    assert r.hscan("h", 0, count=1000) == (0, {})
    assert r.hset("h", "field:1", "back") == 1
    assert r.hgetall("h") == {b"field:1": b"back"}


def test_del_of_several_large_hashes_at_once(r):
    """Five hashes over four shards: two or more share a shard, more items than one batch."""
    keys = [f"big:{n}" for n in range(5)]
    for key in keys:
        assert hset_many(r, key, {f"f{i}": "v" for i in range(5000)}) == 5000
    assert r.delete(*keys, "missing") == 5
    assert r.dbsize() == 0
    for key in keys:
        assert r.hlen(key) == 0
        assert r.hkeys(key) == []


def test_hashes_that_share_a_prefix_stay_apart(rc):
    # The fields of "user" and of "user:1" never mix (length-prefixed item keys).
    rc.hset("user", mapping={":1x": "a", "f": "1"})
    rc.hset("user:1", mapping={"x": "b", "f": "2"})
    rc.hset("use", "r:1f", "c")
    assert rc.hgetall("user") == {b":1x": b"a", b"f": b"1"}
    assert rc.hgetall("user:1") == {b"x": b"b", b"f": b"2"}
    assert rc.hlen("use") == 1
    assert rc.delete("user") == 1
    assert rc.hgetall("user:1") == {b"x": b"b", b"f": b"2"}


# -- concurrency -------------------------------------------------------------------------------


def test_concurrent_hincrby_is_atomic(server, r):
    threads_count, per_thread = 8, 300

    def work(client, _n):
        for _ in range(per_thread):
            client.hincrby("h", "n", 1)

    run_clients(server, threads_count, work)
    assert r.hget("h", "n") == str(threads_count * per_thread).encode()
    assert r.hlen("h") == 1


def test_concurrent_hset_of_distinct_fields_loses_none(server, r):
    def work(client, n):
        pipe = client.pipeline(transaction=False)
        for i in range(250):
            pipe.hset("h", f"t{n}:{i}", n)
        assert pipe.execute() == [1] * 250

    run_clients(server, 8, work)
    assert r.hlen("h") == 2000
    assert len(r.hgetall("h")) == 2000


# -- durability --------------------------------------------------------------------------------


def write_hashes(client: redis.Redis) -> dict:
    """A mix of hash writes; returns what the store must hold afterwards."""
    expected = {}
    big = {f"field:{i}".encode(): f"value:{i}".encode() for i in range(2000)}
    hset_many(client, "big", big)
    client.hdel("big", "field:0", "field:1")
    client.hset("big", "field:2", "rewritten")
    big.pop(b"field:0")
    big.pop(b"field:1")
    big[b"field:2"] = b"rewritten"
    expected["big"] = big
    client.hset("counters", mapping={"a": 1})
    for _ in range(50):
        client.hincrby("counters", "a", 2)
    client.hincrbyfloat("counters", "f", 0.5)
    expected["counters"] = {b"a": b"101", b"f": b"0.5"}
    client.hset("mib", "v", b"\x00\xff" * (MiB // 2))
    expected["mib"] = {b"v": b"\x00\xff" * (MiB // 2)}
    # Gone: emptied by HDEL, deleted whole, replaced by a string.
    client.hset("emptied", mapping={"a": 1, "b": 2})
    client.hdel("emptied", "a", "b")
    hset_many(client, "deleted", {f"f{i}": i for i in range(3000)})
    client.delete("deleted")
    hset_many(client, "replaced", {f"f{i}": i for i in range(10)})
    client.set("replaced", "string")
    return expected


def check_hashes(client: redis.Redis, expected: dict):
    for key, fields in expected.items():
        assert client.hgetall(key) == fields, key
        assert client.hlen(key) == len(fields), key
    assert client.exists("emptied", "deleted") == 0
    assert client.hkeys("deleted") == []
    assert client.type("replaced") == b"string"
    assert client.get("replaced") == b"string"
    assert client.dbsize() == len(expected) + 1


def test_hashes_survive_a_restart(make_server):
    server = make_server()
    client = server.client()
    expected = write_hashes(client)
    client.close()
    server.stop()
    server.restart()
    client = server.client()
    check_hashes(client, expected)
    # The restarted store keeps counting.
    assert client.hincrby("counters", "a", 1) == 102
    assert client.hset("deleted", "again", "1") == 1
    assert client.hlen("deleted") == 1
    client.close()


def test_acknowledged_hash_writes_survive_sigkill(make_server):
    server = make_server()
    client = server.client()
    expected = write_hashes(client)
    client.close()
    server.kill()
    assert_store_checks(server)
    server.restart()
    client = server.client()
    check_hashes(client, expected)
    client.close()


def test_hash_writes_under_load_are_all_or_nothing_across_sigkill(make_server):
    """A writer pipelines HSETs of 20 fields (one command per hash) and HINCRBYs; the kill lands
    mid-load. Every acknowledged HSET is whole after restart; the one in flight is whole or
    absent; the counter is at least what was acknowledged and at most that plus what was in
    flight."""
    server = make_server()
    client = server.client(socket_timeout=20)
    acked_hashes: list[int] = []
    in_flight: list[int] = []
    counts = {"acked": 0, "in_flight": 0}
    errors: list = []
    stop = threading.Event()

    def load():
        n = 0
        while not stop.is_set():
            pipe = client.pipeline(transaction=False)
            batch = list(range(n, n + 10))
            n += 10
            for h in batch:
                pipe.execute_command("HSET", f"h:{h}", *flat({f"f{i}": f"{h}:{i}" for i in range(20)}))
            for _ in range(10):
                pipe.hincrby("counter", "n", 1)
            in_flight[:] = batch
            counts["in_flight"] = 10
            try:
                replies = pipe.execute()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                return
            except Exception as err:  # an error reply: reported by the test
                errors.append(err)
                return
            if replies[:10] != [20] * 10:
                errors.append(AssertionError(f"HSET replies {replies[:10]}"))
                return
            acked_hashes.extend(batch)
            in_flight.clear()
            counts["acked"] += 10
            counts["in_flight"] = 0

    writer = threading.Thread(target=load)
    writer.start()
    time.sleep(0.8)
    server.kill()
    writer.join(timeout=30)
    assert not writer.is_alive()
    client.close()
    assert not errors, errors
    assert acked_hashes, "no pipeline was acknowledged before the kill"
    server.restart()
    checker = server.client()
    whole = {f"f{i}".encode() for i in range(20)}
    pipe = checker.pipeline(transaction=False)
    for h in acked_hashes:
        pipe.hgetall(f"h:{h}")
    for h, fields in zip(acked_hashes, pipe.execute()):
        assert set(fields) == whole, f"acknowledged hash h:{h} has {len(fields)} fields"
        assert fields[b"f19"] == f"{h}:19".encode()
    for h in in_flight:
        assert checker.hlen(f"h:{h}") in (0, 20), f"in-flight HSET of h:{h} applied in part"
    counter = int(checker.hget("counter", "n") or 0)
    assert counts["acked"] <= counter <= counts["acked"] + counts["in_flight"]
    checker.close()
