"""Collections of any size (key space format 2, docs/format/redis-keyspace.md): a hash or sorted
set carries a version, a count and an expiry in its meta item; DEL, an overwrite or a type
change deletes the meta item and writes an orphan record (two small items); the orphan
collector deletes the dead elements in the background and resumes after a crash.

`INFO copse` shows the collector: `orphan_records_seen` (records its last pass found),
`orphan_elements_deleted`, `orphan_keys_collected`; `items` counts every item in the store.
"""

from __future__ import annotations

import random
import time

import pytest
import redis

# More elements than one atomic batch (10,000 items) could delete: format 1 refused these.
LARGE = 25_000
# How long the collector may take over the elements of one test (it deletes 1,000 per batch).
COLLECT_TIMEOUT_S = 60


def info_copse(client: redis.Redis) -> dict:
    return client.info("copse")


def store_items(client: redis.Redis) -> int:
    return int(info_copse(client)["items"])


def wait_collected(client: redis.Redis, items_expected: int) -> dict:
    """Waits until the collector has no orphan record left and the store holds
    `items_expected` items; returns INFO copse then."""
    deadline = time.monotonic() + COLLECT_TIMEOUT_S
    while True:
        info = info_copse(client)
        if int(info["orphan_records_seen"]) == 0 and int(info["items"]) == items_expected:
            return info
        assert time.monotonic() < deadline, f"the collector did not finish: {info}"
        time.sleep(0.05)


def fill_hash(client: redis.Redis, key, fields: int, prefix="f") -> None:
    pipe = client.pipeline(transaction=False)
    for start in range(0, fields, 2_000):
        mapping = {f"{prefix}{i}": f"v{i}" for i in range(start, min(start + 2_000, fields))}
        pipe.hset(key, mapping=mapping)
    pipe.execute()


def fill_zset(client: redis.Redis, key, members: int) -> None:
    pipe = client.pipeline(transaction=False)
    for start in range(0, members, 2_000):
        pipe.zadd(key, {f"m{i}": i for i in range(start, min(start + 2_000, members))})
    pipe.execute()


def test_a_hash_grows_past_what_one_batch_could_delete(r):
    baseline = store_items(r)
    fill_hash(r, "h", LARGE)
    assert r.hlen("h") == LARGE
    assert r.hget("h", f"f{LARGE - 1}") == f"v{LARGE - 1}".encode()
    assert r.hexists("h", "f0") is True
    assert len(r.hkeys("h")) == LARGE
    assert r.hset("h", "f0", "changed") == 0, "an existing field changes the count by nothing"
    assert r.hlen("h") == LARGE
    assert r.hdel("h", "f0", "f1", "missing") == 2
    assert r.hlen("h") == LARGE - 2
    assert r.hincrby("h", "counter", 5) == 5
    assert r.hlen("h") == LARGE - 1
    # One meta item and the fields.
    assert store_items(r) == baseline + 1 + LARGE - 1
    assert r.delete("h") == 1
    assert r.exists("h") == 0 and r.hlen("h") == 0 and r.hgetall("h") == {}
    info = wait_collected(r, baseline)
    assert int(info["orphan_elements_deleted"]) >= LARGE - 1


def test_a_sorted_set_grows_past_what_one_batch_could_delete(r):
    baseline = store_items(r)
    fill_zset(r, "z", LARGE)
    assert r.zcard("z") == LARGE
    assert r.zrange("z", 0, 2) == [b"m0", b"m1", b"m2"]
    assert r.zrevrank("z", "m0") == LARGE - 1
    assert r.zrank("z", f"m{LARGE - 1}") == LARGE - 1
    assert r.zcount("z", 100, 199) == 100
    assert r.zscore("z", "m7") == 7.0
    assert r.zrem("z", "m0", "m1", "nope") == 2
    assert r.zcard("z") == LARGE - 2
    assert r.zadd("z", {"m2": -1}) == 0, "a new score is no new member"
    assert r.zcard("z") == LARGE - 2 and r.zrange("z", 0, 0) == [b"m2"]
    # Two items per member, and the meta item.
    assert store_items(r) == baseline + 1 + 2 * (LARGE - 2)
    assert r.delete("z") == 1
    assert r.zcard("z") == 0 and r.zrange("z", 0, -1) == []
    wait_collected(r, baseline)


def test_a_recreated_key_never_sees_its_dead_elements(r):
    """A new hash or set under a deleted key's name starts empty at once, while the collector may
    still be deleting the old elements; the collector never deletes the new ones."""
    baseline = store_items(r)
    fill_hash(r, "k", 5_000)
    assert r.delete("k") == 1
    assert r.hset("k", "fresh", "1") == 1
    assert r.hgetall("k") == {b"fresh": b"1"}
    assert r.hlen("k") == 1
    # Overwritten by another type, then by a hash again, before anything was collected.
    assert r.set("k", "string now") is True
    assert r.get("k") == b"string now"
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        r.hget("k", "fresh")
    assert r.delete("k") == 1
    assert r.zadd("k", {"a": 1}) == 1
    assert r.zrange("k", 0, -1, withscores=True) == [(b"a", 1.0)]
    # After the collector: the live set is whole, and nothing else is left.
    wait_collected(r, baseline + 3)
    assert r.zrange("k", 0, -1, withscores=True) == [(b"a", 1.0)]
    assert r.zcard("k") == 1


def test_set_over_a_large_hash_is_one_small_write(r):
    baseline = store_items(r)
    fill_hash(r, "h", LARGE)
    before = int(info_copse(r)["user_bytes_written"])
    assert r.set("h", "v") is True
    after = int(info_copse(r)["user_bytes_written"])
    # The collector may have started deleting meanwhile: each of its deletes is one key's bytes.
    # What the SET itself writes is a few dozen bytes; deleting the fields at once would be
    # hundreds of kilobytes in this one batch.
    assert r.get("h") == b"v"
    assert r.type("h") == b"string"
    wait_collected(r, baseline + 1)
    assert after - before < 128 * 1024, (before, after)


def test_the_collector_resumes_after_a_kill(make_server):
    """kill -9 at a random moment while the collector deletes the elements of collections DEL
    made dead, three times: after each restart the deleted keys stay gone, every live key reads
    whole (a hash and a set recreated under a deleted name among them), and the collector
    finishes."""
    rng = random.Random(7)
    server = make_server()
    client = server.client()
    live: dict[str, dict] = {}
    for cycle in range(3):
        fill_hash(client, f"big{cycle}", LARGE)
        fill_zset(client, f"bigz{cycle}", LARGE)
        client.set(f"keep{cycle}", cycle)
        assert client.delete(f"big{cycle}", f"bigz{cycle}") == 2
        # Recreated at once under the dead names: new versions the collector must not touch.
        client.hset(f"big{cycle}", mapping={"a": cycle, "b": "x"})
        client.zadd(f"bigz{cycle}", {"only": cycle})
        live[f"big{cycle}"] = {b"a": str(cycle).encode(), b"b": b"x"}
        time.sleep(rng.uniform(0.0, 0.3))
        server.kill()
        server.restart()
        client = server.client()
        for c in range(cycle + 1):
            assert client.hgetall(f"big{c}") == live[f"big{c}"]
            assert client.zrange(f"bigz{c}", 0, -1, withscores=True) == [(b"only", float(c))]
            assert client.get(f"keep{c}") == str(c).encode()
    # Per cycle: keep (1), the new hash (meta + 2 fields), the new set (meta + 2 items); and the
    # marker.
    wait_collected(client, 3 * (1 + 3 + 3) + 1)
    client.close()


def test_one_key_s_writes_from_many_clients_lose_nothing(server):
    """Writes to one hash and one sorted set from many clients share flushes (a write group,
    docs/format/redis-keyspace.md): every increment counts, HSETNX lets exactly one client win,
    and the counts in the meta items match the elements."""
    import threading

    clients = [server.client() for _ in range(16)]
    clients[0].flushall()
    wins = []

    def work(client, n):
        pipe = client.pipeline(transaction=False)
        for i in range(200):
            pipe.hincrby("h", "counter", 1)
            pipe.zincrby("z", 1, "member")
            pipe.hset("h", f"c{n}-{i}", i)
            pipe.zadd("z", {f"m{n}-{i}": i})
        pipe.execute()
        wins.append(client.hsetnx("h", "winner", n))

    threads = [threading.Thread(target=work, args=(c, n)) for n, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    checker = clients[0]
    assert checker.hget("h", "counter") == b"3200"
    assert checker.zscore("z", "member") == 3200.0
    assert sorted(wins) == [False] * 15 + [True]
    assert checker.hlen("h") == 1 + 16 * 200 + 1 == len(checker.hkeys("h"))
    assert checker.zcard("z") == 1 + 16 * 200 == len(checker.zrange("z", 0, -1))
    for client in clients:
        client.close()


def test_acknowledged_writes_to_one_hash_survive_a_kill(make_server):
    """kill -9 while 8 clients increment one field and add fields to one hash (write groups):
    after the restart every acknowledged increment and field is there, and no more than were
    sent."""
    import threading

    server = make_server()
    acked = [0] * 8
    fields = [[] for _ in range(8)]
    stop = threading.Event()

    def work(n):
        client = server.client(socket_timeout=20)
        i = 0
        try:
            while not stop.is_set():
                client.hincrby("h", "counter", 1)
                acked[n] += 1
                client.hset("h", f"f{n}-{i}", i)
                fields[n].append(f"f{n}-{i}")
                i += 1
        except (redis.ConnectionError, redis.TimeoutError):
            pass

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)
    server.kill()
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    server.restart()
    client = server.client()
    counter = int(client.hget("h", "counter") or 0)
    assert sum(acked) <= counter <= sum(acked) + 8, (counter, sum(acked))
    present = set(client.hkeys("h"))
    for names in fields:
        for name in names:
            assert name.encode() in present, name
    assert client.hlen("h") == len(present)
    client.close()


# The figure: a collection of a million elements is one small write to delete or expire.
MILLION = 1_000_000
# How long the collector may take over a million elements (1,000 per batch).
MILLION_COLLECT_TIMEOUT_S = 300


def test_kills_during_del_expiry_and_collection_of_a_million_element_hash(make_server):
    """A 1,000,000-field hash is deleted (DEL answers at once: two small writes) and the server is
    killed while the collector works; another is given a deadline and the server is killed while
    active expiry and the collector work on it. After each restart the dead hash is invisible,
    every live key (a 1,000-field hash, a sorted set, strings) reads whole, and the collector
    finishes: the store holds exactly the live items."""
    rng = random.Random(1_000_000)
    server = make_server()
    client = server.client(socket_timeout=120)
    fill_hash(client, "live", 1_000, prefix="l")
    fill_zset(client, "livez", 1_000)
    client.set("s", "v")
    live_items = store_items(client)

    def check_live(client):
        assert client.hlen("live") == 1_000 and client.hget("live", "l999") == b"v999"
        assert client.zcard("livez") == 1_000 and client.zscore("livez", "m7") == 7.0
        assert client.get("s") == b"v"

    for name, dies in (("deleted", "del"), ("expired", "expire")):
        fill_hash(client, name, MILLION)
        assert client.hlen(name) == MILLION
        started = time.monotonic()
        if dies == "del":
            assert client.delete(name) == 1
        else:
            assert client.pexpire(name, 100) is True
        took = time.monotonic() - started
        assert took < 1.0, f"{dies} of a million fields took {took:.2f} s"
        # Killed while the collector (and, for the deadline, active expiry) works.
        time.sleep(rng.uniform(0.1, 0.6))
        server.kill()
        server.restart()
        client = server.client(socket_timeout=120)
        assert client.exists(name) == 0 and client.hlen(name) == 0
        assert client.hget(name, "f123456") is None and client.hscan(name, 0) == (0, {})
        check_live(client)
        # A second kill, while the collector resumes.
        time.sleep(rng.uniform(0.1, 0.6))
        server.kill()
        server.restart()
        client = server.client(socket_timeout=120)
        assert client.exists(name) == 0
        check_live(client)
    deadline = time.monotonic() + MILLION_COLLECT_TIMEOUT_S
    while True:
        info = info_copse(client)
        if int(info["orphan_records_seen"]) == 0 and int(info["items"]) == live_items:
            break
        assert time.monotonic() < deadline, f"the collector did not finish: {info}"
        time.sleep(0.2)
    check_live(client)
    client.close()
