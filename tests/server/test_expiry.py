"""Key expiry (issue 23 item 2; docs/format/redis-keyspace.md, "Expiry"): SET's EX/PX/EXAT/PXAT/
KEEPTTL, SETEX, PSETEX, GETEX, EXPIRE/PEXPIRE/EXPIREAT/PEXPIREAT with NX/XX/GT/LT, TTL/PTTL/
EXPIRETIME/PEXPIRETIME and PERSIST, on every type.

- The differential tests send the same commands to copse and to redis-server (installed by
  `make test-deps`) and compare every reply, errors included.
- An expired key is never visible; active expiry deletes it through the per-shard due index;
  INFO shows `expires=` and `expired_keys`; deadlines survive restarts and kills.
"""

from __future__ import annotations

import random
import time

import pytest
import redis

from support import run_script

# How long active expiry may take to delete what expired (it looks 10 times a second).
RECLAIM_TIMEOUT_S = 30


def test_set_options_and_errors_answer_as_redis_does(diff):
    run_script(diff, """
        SET a 1 PXAT 1000
        EXISTS a
        SET a 1
        SET a 2 PXAT 1000 GET
        EXISTS a
        SET c 1 EX 0
        SET c 1 EX -5
        SET c 1 PX 9223372036854775807
        SET c 1 EX 9223372036854775
        SET c 1 KEEPTTL EX 10
        SET c 1 EX 10 KEEPTTL
        SET c 1 EX 10 PX 10
        SET c 1 EX 10 EX 100
        TTL c
        SET c 1 EX abc NX XX
        SET c 1 EX abc
        SET c 1 EX
        SET c 1 PERSIST
        SET c 2 KEEPTTL
        TTL c
        GET c
        SET c 3
        TTL c
        SET c 4 EX 100 NX
        SET c 4 EX 100 XX GET
        TTL c
        SET c 5 EXAT 4102444800
        EXPIRETIME c
        PEXPIRETIME c
        SET c 6 PXAT 4102444800123
        PEXPIRETIME c
        EXPIRETIME c
        SET d 1 ex 100
        TTL d
        SETEX s 0 v
        SETEX s -1 v
        SETEX s abc v
        SETEX s 100 v
        TTL s
        GET s
        PSETEX s 0 v
        PSETEX s 100000 w
        TTL s
        GET s
        SETEX s 9223372036854775 v
    """)


def test_expire_family_answers_as_redis_does(diff):
    run_script(diff, """
        EXPIRE nokey 10
        SET b 1
        EXPIRE b -1
        EXISTS b
        SET e 1
        EXPIRE e 100 NX XX
        EXPIRE e 100 GT LT
        EXPIRE e 100 NX GT
        EXPIRE e 100 foo
        EXPIRE e 100 GT
        TTL e
        EXPIRE e 100 LT
        TTL e
        EXPIRE e 50 GT
        EXPIRE e 200 GT
        TTL e
        EXPIRE e 100 NX
        EXPIRE e 300 XX
        EXPIRE e 300 xx
        TTL e
        EXPIRE e abc
        EXPIRE e abc foo
        EXPIRE e 9223372036854775807 foo
        PEXPIRE e 1.5
        EXPIRE e 9223372036854775807
        EXPIRE e -9223372036854775807
        PEXPIRE e 9223372036854775807
        EXPIREAT e 9223372036854775807
        PEXPIREAT e 9223372036854775807
        EXPIREAT e 92233720368547758
        EXPIREAT e 4102444800
        EXPIRETIME e
        PEXPIREAT e 4102444800999
        EXPIRETIME e
        PEXPIRETIME e
        PEXPIREAT e 4102444800499
        EXPIRETIME e
        PERSIST f
        SET f 1
        EXPIRETIME f
        PEXPIRETIME f
        TTL f
        PTTL f
        PERSIST f
        PERSIST e
        PERSIST e
        TTL e
        TTL nokey
        PTTL nokey
        EXPIRETIME nokey
        PEXPIRETIME nokey
        EXPIREAT e 1
        EXISTS e
        SET g 1
        PEXPIREAT g 0
        GET g
        SET g 1
        EXPIRE g 0
        GET g
        EXPIRE
        TTL
        PERSIST a b
    """)


def test_getex_answers_as_redis_does(diff):
    run_script(diff, """
        GETEX nokey
        GETEX nokey EX 0
        GETEX nokey FOO
        SET e 1
        GETEX e PERSIST EX 10
        GETEX e EX 10 PERSIST
        GETEX e EX 10 PX 10
        GETEX e EX 10 KEEPTTL
        GETEX e EX 0
        GETEX e EX abc
        GETEX e EX 100
        TTL e
        GETEX e PERSIST
        TTL e
        GETEX e
        GETEX e EXAT 4102444800
        EXPIRETIME e
        GETEX e PXAT 1
        EXISTS e
        HSET h f v
        GETEX h
        GETEX h EX 10
        TTL h
    """)


def test_expiry_on_every_type_answers_as_redis_does(diff):
    run_script(diff, """
        HSET h f v g w
        EXPIRE h 100
        TTL h
        HSET h x y
        TTL h
        HDEL h f g x
        EXISTS h
        TTL h
        HSET h f v
        TTL h
        ZADD z 1 a 2 b
        EXPIREAT z 4102444800
        ZADD z 3 c
        ZINCRBY z 1 a
        EXPIRETIME z
        ZREM z a b c
        EXPIRETIME z
        HSET h2 f v
        EXPIRE h2 100
        SET h2 x KEEPTTL
        TYPE h2
        TTL h2
        SET h2 y
        TTL h2
        ZADD z2 1 a
        EXPIRE z2 100
        SETEX z2 10 x
        TYPE z2
        TTL z2
        SET n 10
        EXPIRE n 100
        INCR n
        APPEND n 5
        SETRANGE n 0 2
        INCRBYFLOAT n 1.5
        TTL n
        GETSET n 1
        TTL n
        SET m 1
        EXPIRE m 100
        MSET m 2 o 3
        TTL m
        EXPIRE m 100
        GETDEL m
        TTL m
        SET m 1
        TTL m
        SET q 1
        EXPIRE q 100
        DEL q
        SET q 1
        TTL q
        HSET p f v
        PEXPIRE p 1
    """)


def test_a_key_too_long_for_an_expiry_is_refused_clearly(r):
    """A key of 1,012 to 1,014 bytes can be stored but cannot carry an expiry (its expiry item
    would pass copse's 1,024-byte item key): every way of giving it one is refused, naming the
    limit, and changes nothing; EXPIRE of such a key that does not exist answers 0, as Redis."""
    key = "k" * 1_012
    assert r.expire(key, 100) is False
    for attempt in (
        lambda: r.set(key, "v", ex=100),
        lambda: r.execute_command("SETEX", key, 100, "v"),
        lambda: r.execute_command("PSETEX", key, 100_000, "v"),
    ):
        with pytest.raises(redis.ResponseError, match="at most 1011 bytes"):
            attempt()
        assert r.exists(key) == 0
    r.set(key, "v")
    for attempt in (lambda: r.expire(key, 100), lambda: r.getex(key, ex=100)):
        with pytest.raises(redis.ResponseError, match="at most 1011 bytes"):
            attempt()
    assert r.get(key) == b"v" and r.ttl(key) == -1
    assert r.expire(key, -1) is True and r.exists(key) == 0, "a deadline in the past deletes it"


def test_a_write_never_revives_a_collection_that_expires_during_it(r):
    """INCR on hashes whose deadline passes around the command: each INCR either finds the hash
    (WRONGTYPE) or a missing key (1, a string without expiry); never both, so no hash comes
    back with its fields and no deadline (a review found one that did)."""
    keys = [f"race{i}" for i in range(20_000)]
    pipe = r.pipeline(transaction=False)
    for i, key in enumerate(keys):
        pipe.hset(key, "f", "v")
        pipe.pexpire(key, 1 + i % 30)
        pipe.incr(key)
    replies = pipe.execute(raise_on_error=False)
    incremented = [key for key, reply in zip(keys, replies[2::3]) if reply == 1]
    time.sleep(0.1)
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.type(key)
        pipe.ttl(key)
    found = pipe.execute()
    for key, ty, ttl in zip(keys, found[0::2], found[1::2]):
        assert ty in (b"string", b"none"), f"{key} is a {ty!r} again (TTL {ttl})"
    assert all(r.get(key) == b"1" and r.ttl(key) == -1 for key in incremented[:100])


def wait_until(predicate, what: str, timeout_s: float = RECLAIM_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def keyspace_line(client: redis.Redis) -> dict:
    return client.info("keyspace").get("db0", {"keys": 0, "expires": 0})


@pytest.fixture
def lazy(r):
    """`r` with active expiry off (DEBUG SET-ACTIVE-EXPIRE 0, as Redis's own tests do), so an
    expired key stays in the store until the test turns it back on: every command must see it
    missing all the same."""
    assert r.execute_command("DEBUG", "SET-ACTIVE-EXPIRE", "0") in (b"OK", True)
    try:
        yield r
    finally:
        r.execute_command("DEBUG", "SET-ACTIVE-EXPIRE", "1")


def test_an_expired_key_is_never_visible_to_any_command(lazy):
    """Each type, made to expire 200 ms from now: before the deadline every read sees it; from
    the deadline on, while it is still stored (active expiry off) and after active expiry
    deleted it, none does."""
    r = lazy
    expired_before = int(r.info("stats")["expired_keys"])
    r.set("s", "v", px=200)
    r.hset("h", mapping={"f": "v", "g": "w"})
    r.pexpire("h", 200)
    r.zadd("z", {"a": 1, "b": 2})
    r.pexpire("z", 200)
    r.set("live", "1")
    assert r.get("s") == b"v" and r.hgetall("h") == {b"f": b"v", b"g": b"w"}
    assert r.exists("s", "h", "z", "live") == 4
    time.sleep(0.25)
    # Still stored: DBSIZE counts them (as Redis's does) and INFO shows their expiry items.
    assert keyspace_line(r) == {"keys": 4, "expires": 3, "avg_ttl": 0}
    for round_ in range(2):
        assert r.get("s") is None and r.strlen("s") == 0 and r.getrange("s", 0, -1) == b""
        assert r.mget("s", "live") == [None, b"1"]
        assert r.hgetall("h") == {} and r.hget("h", "f") is None and r.hlen("h") == 0
        assert r.hkeys("h") == [] and r.hexists("h", "f") is False
        assert r.zrange("z", 0, -1) == [] and r.zcard("z") == 0 and r.zscore("z", "a") is None
        assert r.exists("s", "h", "z") == 0
        assert [r.type(k) for k in ("s", "h", "z")] == [b"none"] * 3
        assert [r.ttl(k) for k in ("s", "h", "z")] == [-2, -2, -2]
        assert sorted(r.scan_iter()) == [b"live"] and r.keys("*") == [b"live"]
        assert r.persist("s") is False and r.expire("h", 100) is False
        assert r.getex("s") is None and r.getdel("s") is None and r.hdel("h", "f") == 0
        assert r.zrem("z", "a") == 0 and r.delete("s") == 0
        if round_ == 0:
            r.execute_command("DEBUG", "SET-ACTIVE-EXPIRE", "1")
            wait_until(lambda: keyspace_line(r)["keys"] == 1, "active expiry deleted the keys")
    assert keyspace_line(r)["expires"] == 0
    # h and z by active expiry; s went with the DEL above (which answered 0, as it was missing).
    assert int(r.info("stats")["expired_keys"]) - expired_before == 2


def test_writes_over_an_expired_key_start_from_nothing(lazy):
    """A write to a key whose deadline passed and that is still stored (active expiry off) sees
    a missing key: INCR starts from 0, HSET and ZADD start empty, SET NX sets, and the new key
    has no expiry; the expired key's items go in the write's batch."""
    r = lazy
    r.set("n", 41, px=50)
    r.hset("h", mapping={"old1": "x", "old2": "y"})
    r.pexpire("h", 50)
    r.zadd("z", {"old": 1})
    r.pexpire("z", 50)
    r.set("s", "old", px=50)
    r.hset("t", "f", "v")
    r.pexpire("t", 50)
    r.set("d", "old", px=50)
    time.sleep(0.1)
    assert keyspace_line(r)["expires"] == 6
    assert r.incr("n") == 1 and r.ttl("n") == -1
    assert r.hset("h", "new", "1") == 1 and r.hgetall("h") == {b"new": b"1"} and r.ttl("h") == -1
    assert r.hlen("h") == 1
    assert r.zadd("z", {"new": 2}) == 1 and r.zrange("z", 0, -1, withscores=True) == [(b"new", 2.0)]
    assert r.zcard("z") == 1 and r.ttl("z") == -1
    assert r.set("s", "x", nx=True) is True and r.get("s") == b"x" and r.ttl("s") == -1
    assert r.set("t", "now a string") is True and r.type("t") == b"string" and r.ttl("t") == -1
    assert r.hset("t2", "f", "v") == 1
    # DEL of an expired key answers 0 and deletes it.
    assert r.delete("d") == 0
    # No expiry is left behind for the keys that replaced expired ones.
    assert keyspace_line(r)["expires"] == 0
    assert sorted(r.keys("*")) == [b"h", b"n", b"s", b"t", b"t2", b"z"]
    assert keyspace_line(r)["keys"] == 6


def test_active_expiry_reclaims_many_keys_in_bounded_rounds(r):
    """5,000 keys of all three types expire at once; active expiry deletes every one (more than
    one batch per shard), leaves the keys without expiry alone, and INFO counts them."""
    before = int(r.info("stats")["expired_keys"])
    # Deadlines far enough ahead that the 15,000 writes are in before the first one passes,
    # even on a loaded machine (at 300 ms, a run beside a compile saw keys expire mid-load).
    ttl_ms = 3_000
    pipe = r.pipeline(transaction=False)
    for i in range(5_000):
        kind = i % 3
        if kind == 0:
            pipe.set(f"s{i}", "v", px=ttl_ms)
        elif kind == 1:
            pipe.hset(f"h{i}", "f", "v")
            pipe.pexpire(f"h{i}", ttl_ms)
        else:
            pipe.zadd(f"z{i}", {"m": 1})
            pipe.pexpire(f"z{i}", ttl_ms)
    for i in range(100):
        pipe.set(f"keep{i}", i)
    pipe.execute()
    assert keyspace_line(r) == {"keys": 5_100, "expires": 5_000, "avg_ttl": 0}
    wait_until(lambda: keyspace_line(r)["keys"] == 100, "active expiry deleted 5,000 keys")
    assert keyspace_line(r)["expires"] == 0
    assert int(r.info("stats")["expired_keys"]) - before == 5_000
    assert sorted(r.keys("*")) == sorted(f"keep{i}".encode() for i in range(100))
    # The expired collections' elements go too (the orphan collector).
    wait_until(lambda: int(r.info("copse")["orphan_records_seen"]) == 0, "orphans collected")
    wait_until(lambda: int(r.info("copse")["items"]) == 101, "only the live keys and the marker")


def test_deadlines_survive_a_restart_and_a_kill(make_server):
    """Deadlines are absolute and persisted: after a clean restart and after kill -9, a key
    keeps its deadline, and one whose deadline passed while the server was down is gone."""
    server = make_server()
    r = server.client()
    r.set("long", "v", ex=1000)
    r.hset("h", "f", "v")
    r.expireat("h", 4102444800)
    r.set("short", "v", px=1500)
    r.zadd("z", {"m": 1})
    r.pexpire("z", 1500)
    r.set("plain", "v")
    long_deadline = r.pexpiretime("long")
    r.close()
    server.stop()
    server.start()
    r = server.client()
    assert r.pexpiretime("long") == long_deadline and r.expiretime("h") == 4102444800
    assert r.ttl("plain") == -1 and r.exists("short", "z") == 2
    r.close()
    server.kill()
    time.sleep(1.6)
    server.restart()
    r = server.client()
    assert r.exists("short", "z") == 0 and r.get("short") is None and r.zcard("z") == 0
    assert r.pexpiretime("long") == long_deadline and r.get("long") == b"v"
    assert r.hget("h", "f") == b"v" and r.get("plain") == b"v"
    wait_until(lambda: keyspace_line(r)["keys"] == 3, "the keys that expired while down go")
    assert keyspace_line(r)["expires"] == 2
    r.close()


def load_expired(r: redis.Redis, prefix: str, count: int) -> None:
    """`count` keys that expire at once, half strings, half hashes, with active expiry off so
    that they stay stored (a backlog for active expiry once it runs again)."""
    r.execute_command("DEBUG", "SET-ACTIVE-EXPIRE", "0")
    pipe = r.pipeline(transaction=False)
    for i in range(count):
        if i % 2:
            pipe.set(f"{prefix}{i}", "v", px=1)
        else:
            pipe.hset(f"{prefix}h{i}", mapping={"a": "1", "b": "2"})
            pipe.pexpire(f"{prefix}h{i}", 1)
        if len(pipe) >= 2_000:
            pipe.execute()
    pipe.execute()


def test_a_kill_during_active_expiry_loses_no_live_key(make_server):
    """kill -9 while active expiry deletes a backlog of 20,000 expired keys (half strings, half
    hashes), three times, each over a fresh backlog: after each restart no expired key is
    visible (nor listed by SCAN), every key without expiry and every field of the live hashes
    is there, and active expiry finishes the rest."""
    rng = random.Random(23)
    server = make_server()
    r = server.client()
    live = 200
    pipe = r.pipeline(transaction=False)
    for i in range(live):
        pipe.set(f"live{i}", i)
        pipe.hset(f"liveh{i}", mapping={"a": i, "b": i})
    pipe.execute()
    backlogs = []
    for round_ in range(3):
        prefix = f"x{round_}:"
        # The round before left active expiry a backlog; loading turns it off, so the last of
        # that backlog would stay and count here (seen under load: 20,150 expiry items).
        wait_until(lambda: keyspace_line(r)["expires"] == 0, "the last backlog expired")
        load_expired(r, prefix, 20_000)
        time.sleep(0.01)
        assert keyspace_line(r)["expires"] == 20_000
        r.close()
        # Active expiry runs again from the restart (the switch is not persisted), as after a
        # crash; the kill lands while it works through the backlog.
        server.kill()
        server.restart()
        time.sleep(rng.random() * 0.05)
        server.kill()
        server.restart()
        r = server.client()
        backlogs.append(keyspace_line(r)["expires"])
        assert r.exists(*[f"{prefix}{i}" for i in range(1, 20_000, 97)]) == 0
        assert r.hgetall(f"{prefix}h0") == {} and r.ttl(f"{prefix}h2") == -2
        assert r.hlen(f"{prefix}h19998") == 0
        cursor, seen = 0, []
        while True:
            cursor, page = r.scan(cursor, match="x*", count=1000)
            seen += page
            if cursor == 0:
                break
        assert seen == [], f"round {round_}: SCAN lists expired keys {seen[:5]}"
        for i in range(live):
            assert r.get(f"live{i}") == str(i).encode()
            assert r.hgetall(f"liveh{i}") == {b"a": str(i).encode(), b"b": str(i).encode()}
    print(f"expiry items left at each restart: {backlogs}")
    assert any(backlog > 0 for backlog in backlogs), "no kill landed in active expiry's work"
    wait_until(lambda: keyspace_line(r)["keys"] == 2 * live, "active expiry finished")
    assert keyspace_line(r)["expires"] == 0
    wait_until(lambda: int(r.info("copse")["orphan_records_seen"]) == 0, "orphans collected")
    r.close()
