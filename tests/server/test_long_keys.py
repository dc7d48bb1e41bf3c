"""Long Redis keys (issue 23 item 7): keys up to 1 MiB work for every command and type, stored
under a surrogate name with a name item (docs/format/redis-keyspace.md, "Stored names").

The differential tests send the same commands to copse and to redis-server and compare the
replies byte for byte, with 64 KiB and 1 MiB keys at every key position of every command that
takes keys (`test_every_key_command_is_exercised` checks the script covers copse's whole command
table), with the keys around the inline limit (1013, 1014, 1015 bytes) and with a short key that
starts with the surrogate prefix. The rest is copse's own: the limit (1 MiB) and the error one
byte past it, blocking pops woken on a long key, name items reclaimed by active expiry and
FLUSHDB (INFO's item count back to an empty store's), and long keys across a clean restart and
a kill -9.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from support import Differential, shown

KEY_BYTES_MAX = 1 << 20  # keyspace::REDIS_KEY_BYTES_MAX
NAME_INLINE_BYTES_MAX = 1013  # keyspace::NAME_INLINE_BYTES_MAX
SURROGATE_PREFIX = b"\xff\xc0#N"  # keyspace::SURROGATE_PREFIX
UNORDERED = {
    "SMEMBERS", "HGETALL", "HKEYS", "HVALS", "KEYS", "SINTER", "SUNION", "SDIFF", "HSCAN",
    "SSCAN", "ZSCAN", "SCAN",
}
DEADLINE_MS = int(time.time() * 1000) + 3_600_000


def long_key(tag: str, length: int) -> bytes:
    """A key of `length` bytes starting with `tag:`, holding every byte value."""
    head = tag.encode() + b":"
    body = bytes(range(256)) * (length // 256 + 1)
    return (head + body)[:length]


# Every command that takes keys, each line a command whose words K, K2, K3 (long keys, or the
# keys under test) and S (a short key) are replaced. Replies are compared with redis-server's.
SCRIPT = """
DEL K K2 K3 S
SET K hello
GET K
EXISTS K K2 S K
TYPE K
STRLEN K
APPEND K !
GETRANGE K 0 3
SETRANGE K 1 a
SETNX K other
GETSET K v1
GETDEL K
SET K 10
INCR K
INCRBY K 5
DECR K
DECRBY K 2
INCRBYFLOAT K 1.5
GETEX K PXAT DEADLINE
PEXPIRETIME K
EXPIRETIME K
PERSIST K
PEXPIREAT K DEADLINE
EXPIREAT K 4102444800
PEXPIRETIME K
SETEX K 1000 x
PSETEX K 1000000 y
MSET K a K2 b S c
MGET K K2 S K3
MSETNX K3 d K e
TOUCH K K2 K3
OBJECT ENCODING K
SET K 12345
OBJECT ENCODING K
RENAME K K3
RENAMENX K3 K2
RENAME K3 S
RENAME S K
COPY K K3
COPY K S REPLACE
COPY K2 K REPLACE
GET K
DEL K K2
UNLINK K3 S
EXISTS K K2 K3 S
HSET K f1 v1 f2 v2
HGET K f1
HMGET K f1 nof f2
HGETALL K
HKEYS K
HVALS K
HLEN K
HEXISTS K f2
HSTRLEN K f1
HINCRBY K n 3
HINCRBYFLOAT K x 2.5
HSETNX K f1 no
HMSET K f3 v3
HDEL K f2 nof
HSCAN K 0 COUNT 100
TYPE K
PEXPIREAT K DEADLINE
PEXPIRETIME K
OBJECT ENCODING K
RENAME K S
HGETALL S
RENAME S K
DEL K
ZADD K 1 a 2 b 3 c 4 d
ZADD K2 2 b 3 c 10 z
ZSCORE K b
ZMSCORE K a nom d
ZINCRBY K 0.5 a
ZCARD K
ZCOUNT K 1 3
ZRANGE K 0 -1 WITHSCORES
ZREVRANGE K 0 1
ZRANGEBYSCORE K 2 +inf LIMIT 0 2
ZREVRANGEBYSCORE K +inf 2
ZRANK K c
ZREVRANK K c
ZRANGESTORE K3 K 0 1
ZRANGE K3 0 -1 WITHSCORES
ZUNION 2 K K2 WITHSCORES
ZINTER 2 K K2 WITHSCORES
ZDIFF 2 K K2 WITHSCORES
ZUNIONSTORE K3 2 K K2 WEIGHTS 1 2
ZINTERSTORE K3 2 K K2 AGGREGATE MAX
ZDIFFSTORE K3 2 K K2
ZRANGE K3 0 -1 WITHSCORES
ZINTERCARD 2 K K2 LIMIT 5
ZSCAN K 0 COUNT 100
OBJECT ENCODING K
ZPOPMIN K
ZPOPMAX K
ZMPOP 2 S K MIN COUNT 1
BZPOPMIN K 1
BZPOPMAX K2 1
BZMPOP 1 2 S K2 MAX COUNT 5
ZADD K 0 a 0 b 0 c 0 d
ZRANGEBYLEX K [b +
ZREVRANGEBYLEX K + (a
ZLEXCOUNT K - +
ZREMRANGEBYLEX K - [a
ZREMRANGEBYRANK K 0 0
ZADD K 5 q
ZREMRANGEBYSCORE K 4 6
ZREM K c nom
ZRANGE K 0 -1 WITHSCORES
EXISTS K K2 K3
DEL K K2 K3
RPUSH K a b c d
LPUSH K z
LPUSHX K y
RPUSHX K e
LPUSHX K2 no
LLEN K
LINDEX K 2
LRANGE K 0 -1
LSET K 1 Y
LINSERT K BEFORE c C
LREM K 1 C
LPOS K d
LTRIM K 0 5
LPOP K
RPOP K
LMOVE K K2 LEFT RIGHT
RPOPLPUSH K K2
BLMOVE K2 K RIGHT LEFT 1
BRPOPLPUSH K K3 1
LMPOP 2 S K LEFT COUNT 2
BLMPOP 1 2 S K3 RIGHT
BLPOP S K 1
RPUSH K2 q r
BRPOP S K2 1
LRANGE K 0 -1
LRANGE K2 0 -1
OBJECT ENCODING K2
PEXPIREAT K2 DEADLINE
PEXPIRETIME K2
DEL K K2 K3
SADD K a b c 1
SADD K2 b c z
SISMEMBER K a
SMISMEMBER K a no c
SMEMBERS K
SCARD K
SREM K 1 no
SMOVE K K2 a
SINTER K K2
SUNION K K2 S
SDIFF K2 K
SINTERSTORE K3 K K2
SUNIONSTORE K3 K K2
SDIFFSTORE K3 K2 K
SMEMBERS K3
SINTERCARD 2 K K2 LIMIT 1
SSCAN K2 0 COUNT 100
OBJECT ENCODING K
SADD S only
SPOP S
DEL K3
SADD K3 one
SRANDMEMBER K3
SPOP K3
EXISTS K K2 K3 S
PEXPIREAT K DEADLINE
PEXPIRETIME K
WATCH K K2
SET K watched
MULTI
GET K
EXEC
UNWATCH
DEL K K2 K3 S
"""

# Commands whose keys the script covers with another scenario below (the database commands,
# DUMP and RESTORE, the random choices).
ELSEWHERE = {"move", "dump", "restore", "hrandfield", "zrandmember", "memory", "ttl", "pttl",
             "expire", "pexpire"}


def run(diff: Differential, keys: dict[str, bytes], script: str = SCRIPT) -> None:
    for line in script.strip().splitlines():
        words = line.split()
        args = [keys.get(word, word.replace("DEADLINE", str(DEADLINE_MS)).encode())
                for word in words]
        diff.both(*args, unordered=words[0].upper() in UNORDERED)


def key_set(tag: str, length: int) -> dict[str, bytes]:
    key = long_key(tag, length)
    # K2 and K3 differ from K only in their last bytes: distinct keys, one surrogate each.
    return {"K": key, "K2": key[:-1] + b"\x01", "K3": key[:-1] + b"\x02", "S": b"short"}


def test_every_key_command_is_exercised(r):
    """The script names every command of copse's table that takes a key (by its key positions
    or by a numkeys argument), except those the tests below cover by hand."""
    table = r.execute_command("COMMAND")
    numkeys = {"zunion", "zinter", "zdiff", "zintercard"}
    with_keys = {name for name, info in table.items()
                 if info["first_key_pos"] > 0 or name in numkeys}
    scripted = {line.split()[0].lower() for line in SCRIPT.strip().splitlines()}
    assert with_keys - scripted - ELSEWHERE == set()
    assert ELSEWHERE <= with_keys


@pytest.mark.parametrize("length", [65_536, KEY_BYTES_MAX], ids=["64KiB", "1MiB"])
def test_every_command_answers_as_redis_with_long_keys(diff, length):
    run(diff, key_set("long", length))
    diff.both("DBSIZE")


@pytest.mark.parametrize("length", [NAME_INLINE_BYTES_MAX + 1, NAME_INLINE_BYTES_MAX + 2])
def test_keys_just_past_the_inline_limit_answer_as_redis(diff, length):
    run(diff, key_set("edge", length))


def test_a_short_key_starting_with_the_surrogate_prefix_is_its_own_key(diff, r):
    """Such a key is stored under a surrogate too (so no stored name is ambiguous), and reads
    back as itself everywhere, SCAN and KEYS included."""
    keys = {"K": SURROGATE_PREFIX + b"a", "K2": SURROGATE_PREFIX, "K3": SURROGATE_PREFIX + b"\x00",
            "S": b"short"}
    run(diff, keys)
    diff.both("MSET", keys["K"], "1", keys["K2"], "2", "plain", "3")
    diff.both("KEYS", "*", unordered=True)
    assert sorted(r.scan_iter(count=1000)) == sorted([keys["K"], keys["K2"], b"plain"])


def test_the_inline_limit_keeps_keys_as_they_were(diff, r):
    """A key of 1013 bytes is stored inline, as in format 6 (so an old store's keys keep their
    names): strings work as in Redis. A list or a deadline does not fit such a key's items
    (1004 to 1013 and 1012 to 1013 bytes: the window docs/format/redis-keyspace.md describes),
    and is refused with an error that says so, changing nothing; one byte longer, it works."""
    key = long_key("edge", NAME_INLINE_BYTES_MAX)
    run(diff, {"K": key}, """
        SET K v
        APPEND K w
        GET K
        MSET K a
        TYPE K
        KEYS *
        DEL K
    """)
    with pytest.raises(redis.ResponseError, match="cannot hold a list"):
        r.rpush(key, "a")
    with pytest.raises(redis.ResponseError, match="cannot expire"):
        r.set(key, "v", px=10_000)
    assert r.exists(key) == 0
    longer = key + b"!"
    assert r.rpush(longer, "a") == 1 and r.pexpire(longer, 100_000)
    assert r.lrange(longer, 0, -1) == [b"a"] and r.type(longer) == b"list"


def test_scan_keys_and_randomkey_show_the_keys_and_match_on_them(diff, r):
    string, hash_key = long_key("scan:s", 70_000), long_key("scan:h", 80_000)
    diff.both("SET", string, "v")
    diff.both("HSET", hash_key, "f", "v")
    diff.both("SET", "scan:short", "v")
    diff.both("SET", "other", "v")
    for pattern in ("*", "scan:*", "scan:?:*", "*\x00\x01\x02*", "nomatch*", "scan:h:*"):
        diff.both("KEYS", pattern, unordered=True)
        diff.both("SCAN", "0", "MATCH", pattern, "COUNT", "1000", unordered=True)
    for kind in ("string", "hash", "zset"):
        diff.both("SCAN", "0", "TYPE", kind, "COUNT", "1000", unordered=True)
    diff.both("SCAN", "0", "MATCH", "scan:*", "TYPE", "hash", "COUNT", "1000", unordered=True)
    # A walk one key at a time finds each key once, as its client wrote it.
    assert sorted(r.scan_iter(count=1)) == sorted([string, hash_key, b"scan:short", b"other"])
    diff.both("DEL", "scan:short", "other", string)
    diff.both("RANDOMKEY")
    assert r.randomkey() == hash_key


def test_databases_move_copy_and_swap_long_keys(diff):
    keys = key_set("db", 100_000)
    run(diff, keys, """
        HSET K f v g w
        RPUSH K2 a b
        PEXPIREAT K DEADLINE
        MOVE K 3
        EXISTS K
        COPY K2 K3 DB 5
        SELECT 3
        HGETALL K
        PEXPIRETIME K
        KEYS *
        COPY K S DB 0
        MOVE K 0
        SELECT 5
        LRANGE K3 0 -1
        SWAPDB 5 0
        LRANGE K3 0 -1
        KEYS *
        SWAPDB 0 5
        SELECT 0
        HGETALL S
        HGETALL K
        DBSIZE
        FLUSHDB
        DBSIZE
        SELECT 5
        DBSIZE
        FLUSHALL
    """)


def test_dump_and_restore_carry_long_keys(diff, server, oracle, r):
    keys = key_set("dump", 65_536)
    theirs = redis.Redis(port=oracle.port)
    run(diff, keys, """
        ZADD K 1 a 2 b
        HSET K2 f v
    """)
    for key in (keys["K"], keys["K2"]):
        ours_payload, their_payload = r.dump(key), theirs.dump(key)
        diff.both("RESTORE", keys["K3"], "0", their_payload, "REPLACE")
        diff.both("TYPE", keys["K3"])
        assert r.restore(keys["K3"], 0, ours_payload, replace=True) in (True, b"OK")
        assert r.dump(keys["K3"]) == ours_payload
    diff.both("HGETALL", keys["K3"], unordered=True)
    theirs.close()


def test_random_choices_memory_and_ttl_of_long_keys(r):
    key = long_key("rand", 65_536)
    r.hset(key, mapping={"f": "v"})
    assert r.hrandfield(key) == b"f"
    r.delete(key)
    r.zadd(key, {"m": 1})
    assert r.zrandmember(key) == b"m"
    assert isinstance(r.memory_usage(key), int)
    assert r.expire(key, 1000) and 990 <= r.ttl(key) <= 1000
    assert r.pexpire(key, 1_000_000) and 990_000 <= r.pttl(key) <= 1_000_000


def test_keys_past_the_limit_are_refused_alike_by_reads_and_writes(r):
    longest = long_key("max", KEY_BYTES_MAX)
    assert r.set(longest, "v") and r.get(longest) == b"v"
    over = long_key("max", KEY_BYTES_MAX + 1)
    expected = f"key of {KEY_BYTES_MAX + 1} bytes is too long (copse keys are at most {KEY_BYTES_MAX} bytes)"
    errors = set()
    for attempt in (lambda: r.get(over), lambda: r.set(over, "v"), lambda: r.hset(over, "f", "v"),
                    lambda: r.delete(over), lambda: r.exists(over),
                    lambda: r.zunionstore("d", [over]), lambda: r.lmpop(1, over, direction="LEFT")):
        with pytest.raises(redis.ResponseError) as info:
            attempt()
        errors.add(str(info.value))
    assert len(errors) == 1 and expected in errors.pop()
    assert r.dbsize() == 1


def test_blpop_woken_by_a_push_on_a_long_key_names_it(server, r):
    key, other = long_key("block", 65_536), long_key("block2", 300_000)
    replies = []

    def wait():
        client = server.client()
        replies.append(client.blpop([other, key], timeout=10))
        replies.append(client.execute_command("BLMPOP", 10, 1, other, "LEFT"))
        replies.append(client.bzpopmin([key], timeout=10))
        client.close()

    waiter = threading.Thread(target=wait)
    waiter.start()
    for push in (lambda: r.rpush(key, "x"), lambda: r.rpush(other, "y"),
                 lambda: r.zadd(key, {"m": 2})):
        time.sleep(0.3)
        push()
    waiter.join(15)
    assert replies == [(key, b"x"), [other, [b"y"]], (key, b"m", 2.0)]


def items(client) -> int:
    return int(client.info("copse")["items"])


def wait_until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def fill_long_keys(client, tag: str) -> dict[bytes, object]:
    """A long key of each type (one with a deadline) and what it must read back as."""
    string, hash_key, zset, lst, members = (long_key(f"{tag}:{kind}", 65_536 + n)
                                            for n, kind in enumerate("shzlS"))
    client.set(string, b"value")
    client.hset(hash_key, mapping={"f": "1", "g": "2"})
    client.zadd(zset, {"a": 1, "b": 2.5})
    client.rpush(lst, "x", "y")
    client.sadd(members, "m", "n")
    client.pexpireat(hash_key, DEADLINE_MS)
    return {string: b"value", hash_key: {b"f": b"1", b"g": b"2"},
            zset: [(b"a", 1.0), (b"b", 2.5)], lst: [b"x", b"y"], members: {b"m", b"n"}}


def read(client, key: bytes):
    kind = client.type(key)
    return {b"string": lambda: client.get(key), b"hash": lambda: client.hgetall(key),
            b"zset": lambda: client.zrange(key, 0, -1, withscores=True),
            b"list": lambda: client.lrange(key, 0, -1), b"set": lambda: client.smembers(key),
            b"none": lambda: None}[kind]()


def test_active_expiry_and_flushdb_reclaim_long_keys_whole(make_server):
    """Every item of a long key, its name item included, goes with it: after active expiry
    (and the orphan collector) and after FLUSHDB the store holds as many items as when empty."""
    server = make_server()
    r = server.client()
    empty = items(r)
    keys = fill_long_keys(r, "exp")
    assert items(r) > empty
    for key in keys:
        r.pexpire(key, 200)
    assert wait_until(lambda: r.dbsize() == 0)
    assert wait_until(lambda: items(r) == empty), f"{items(r)} items left, {empty} when empty"
    assert list(r.scan_iter()) == []
    fill_long_keys(r, "flush")
    db2 = server.client(db=2)
    fill_long_keys(db2, "flush2")
    db2.flushdb()
    r.flushdb()
    assert wait_until(lambda: items(r) == empty), f"{items(r)} items left, {empty} when empty"


def test_long_keys_survive_a_restart_and_a_kill(make_server):
    server = make_server()
    client = server.client()
    expected = fill_long_keys(client, "keep")
    other_db = server.client(db=7)
    expected_7 = fill_long_keys(other_db, "keep7")
    for stop in ("restart", "kill"):
        if stop == "kill":
            server.kill()
        else:
            server.stop()
        server.start()
        client, other_db = server.client(), server.client(db=7)
        for db, wanted in ((client, expected), (other_db, expected_7)):
            for key, value in wanted.items():
                got = read(db, key)
                if isinstance(value, set):
                    got = set(got)
                assert got == value, (stop, shown(key))
            assert sorted(db.scan_iter()) == sorted(wanted)
        assert 0 < client.pttl(next(iter(k for k in expected if b":h:" in k)))


# -- found by review ---------------------------------------------------------------------------


def test_flushdb_racing_sets_of_long_keys_leaves_no_meta_item_without_its_name(make_server):
    """FLUSHDB takes no key locks: a SET of a long key racing it used to write its meta item
    alone (the name item was put only if the index lacked it), the flush then deleted the name,
    and KEYS and SCAN failed for the whole database. Now every batch that writes a surrogate's
    meta item writes its name item too, and the flush deletes name items only with their meta
    items."""
    server = make_server(shards=1)
    r = server.client()
    keys = [SURROGATE_PREFIX + b"race%d" % i + b"y" * 1100 for i in range(20_000)]
    # The race is a matter of timing: the old code failed in one round of three, about.
    for round_ in range(6):
        r.flushall()
        pipe = r.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, "v")
        pipe.execute()
        # SCAN's order is the order FLUSHDB deletes meta items in: rewrite the first ones.
        _, first = r.scan(0, count=4000)
        done = threading.Event()

        def writer(seed):
            import random
            client, rng = server.client(), random.Random(seed)
            while not done.is_set():
                pipe = client.pipeline(transaction=False)
                for key in rng.sample(first, 300):
                    pipe.set(key, "w")
                pipe.execute()

        threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(0.2)
        r.flushdb()
        time.sleep(0.05)
        done.set()
        for thread in threads:
            thread.join()
        listed = r.keys("*")
        assert len(listed) == r.dbsize(), f"round {round_}"
        assert all(r.get(key) == b"w" for key in listed[:50])
        cursor, seen = 0, 0
        while True:
            cursor, page = r.scan(cursor, count=1000)
            seen += len(page)
            if cursor == 0:
                break
        assert seen == len(listed)


def test_a_batch_of_many_long_keys_costs_linear_time(make_server):
    """`names::maintain` compared every surrogate with every other: an MSET of 160,000 keys
    starting with the prefix took 11 s and stalled the shard (an unrelated GET waited 10 s)."""
    server = make_server(shards=1)
    r = server.client()
    keys = [SURROGATE_PREFIX + b"k%d" % i for i in range(160_000)]
    started = time.monotonic()
    assert r.mset({key: b"x" for key in keys}) is True
    assert r.delete(*keys) == len(keys)
    assert time.monotonic() - started < 8, "MSET and DEL of 160,000 surrogates"


def test_memory_usage_counts_a_long_keys_name_item(r):
    key = b"m" * 1_000_000
    r.set(key, "v")
    assert r.memory_usage(key) > 1_000_000
    r.delete(key)
