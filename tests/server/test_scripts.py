"""Lua scripts (issue 24 item 3): EVAL, EVALSHA, EVAL_RO, EVALSHA_RO, SCRIPT LOAD/EXISTS/FLUSH.

The differential tests send the same scripts to copse and to redis-server and compare replies
byte for byte, errors included (type conversions both ways, redis.call and redis.pcall errors,
the sandbox's read-only globals, script errors after writes). The tests with real clients run
redis-py's `Lock` (acquire, extend, release are Lua scripts) under contention and
`register_script`. A kill test checks that a script's writes survive a crash all together or
not at all, and a runaway script is stopped with nothing written.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import redis

from support import Differential, assert_groups_survive_kills


def scripts(diff: Differential, cases: list[tuple]) -> None:
    for case in cases:
        diff.both(*case)


def test_values_convert_both_ways_as_in_redis(diff):
    scripts(diff, [
        ("EVAL", "return 1", "0"),
        ("EVAL", "return 3.99", "0"),
        ("EVAL", "return -2.5", "0"),
        ("EVAL", "return true", "0"),
        ("EVAL", "return false", "0"),
        ("EVAL", "return nil", "0"),
        ("EVAL", "return 'text'", "0"),
        ("EVAL", "return {1, 2, {3, 'four', {}}, 'x'}", "0"),
        ("EVAL", "return {1, nil, 3}", "0"),
        ("EVAL", "return {err = 'My Error'}", "0"),
        ("EVAL", "return {ok = 'FINE'}", "0"),
        ("EVAL", "return redis.error_reply('E2 custom')", "0"),
        ("EVAL", "return redis.status_reply('DONE')", "0"),
        ("EVAL", "return redis.sha1hex('')", "0"),
        ("EVAL", "return {KEYS[1], KEYS[2], ARGV[1], ARGV[2], #KEYS, #ARGV}", "2", "a", "b", "x", "y"),
        ("SET", "n", "41"),
        ("EVAL", "return redis.call('INCR', KEYS[1])", "1", "n"),
        ("EVAL", "return redis.call('GET', KEYS[1])", "1", "n"),
        ("EVAL", "return redis.call('GET', KEYS[1])", "1", "missing"),
        ("EVAL", "return type(redis.call('GET', KEYS[1]))", "1", "missing"),
        ("EVAL", "return redis.call('SET', KEYS[1], 'v')", "1", "s"),
        ("EVAL", "return redis.call('SET', KEYS[1], 12.5)", "1", "s"),
        ("GET", "s"),
        ("EVAL", "return redis.call('HSET', KEYS[1], 'a', 1)", "1", "h"),
        ("EVAL", "return redis.call('HGET', KEYS[1], 'a')", "1", "h"),
        ("EVAL", "return redis.call('RPUSH', KEYS[1], 'a', 'b', 'c')", "1", "l"),
        ("EVAL", "return redis.call('LRANGE', KEYS[1], 0, -1)", "1", "l"),
        ("EVAL", "return redis.call('ZADD', KEYS[1], 1.5, 'm')", "1", "z"),
        ("EVAL", "return redis.call('ZSCORE', KEYS[1], 'm')", "1", "z"),
        ("EVAL", "return redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')", "1", "z"),
        ("EVAL", "return redis.call('EXISTS', KEYS[1])", "1", "l"),
        ("EVAL", "return redis.call('TYPE', KEYS[1])", "1", "l"),
        ("EVAL", "return redis.call('PING')", "0"),
    ])


def test_errors_are_worded_as_redis_words_them(diff):
    diff.both("SET", "str", "text")
    scripts(diff, [
        ("EVAL", "return redis.call('INCR', KEYS[1])", "1", "str"),
        ("EVAL", "return redis.pcall('INCR', KEYS[1])", "1", "str"),
        ("EVAL", "local ok = pcall(redis.call, 'INCR', KEYS[1]); return ok", "1", "str"),
        ("EVAL", "error('boom')", "0"),
        ("EVAL", "return error({err = 'X failed'})", "0"),
        ("EVAL", "x = 5", "0"),
        ("EVAL", "return undefined_global", "0"),
        ("EVAL", "return redis.call('nosuchcommand')", "0"),
        ("EVAL", "return redis.call('GET')", "0"),
        ("EVAL", "return redis.call()", "0"),
        ("EVAL", "return redis.call('MULTI')", "0"),
        ("EVAL", "return redis.call('SET', KEYS[1], {})", "1", "str"),
        ("EVAL", "retur n", "0"),
        ("EVAL", "return 1", "-1"),
        ("EVAL", "return 1", "2", "a"),
        ("EVAL", "return 1", "notanumber"),
        ("EVAL_RO", "return redis.call('SET', KEYS[1], 1)", "1", "str"),
        ("EVAL_RO", "return redis.call('GET', KEYS[1])", "1", "str"),
        ("EVALSHA", "ffffffffffffffffffffffffffffffffffffffff", "0"),
    ])


def test_writes_before_an_error_stay_as_in_redis(diff):
    scripts(diff, [
        ("EVAL", "redis.call('SET', KEYS[1], 'written'); error('after the write')", "1", "w"),
        ("GET", "w"),
        ("EVAL", "redis.call('SET', KEYS[1], 'again'); return redis.call('INCR', KEYS[1])", "1", "w"),
        ("GET", "w"),
    ])


def test_a_script_reads_its_own_writes(diff, r):
    # Two keys of one shard (copse runs a script in one), the same names on both servers.
    first, second = same_shard_keys(r, 2, "own")
    scripts(diff, [
        ("RPUSH", first, "a", "b"),
        ("EVAL", """
            redis.call('DEL', KEYS[1])
            local gone = redis.call('LLEN', KEYS[1])
            redis.call('RPUSH', KEYS[1], 'new')
            redis.call('HSET', KEYS[2], 'f', 'v', 'g', 'w')
            redis.call('HDEL', KEYS[2], 'g')
            return {gone, redis.call('LRANGE', KEYS[1], 0, -1), redis.call('HGET', KEYS[2], 'f'),
                    redis.call('HLEN', KEYS[2]), redis.call('HEXISTS', KEYS[2], 'g')}
        """, "2", first, second),
        ("LRANGE", first, "0", "-1"),
    ])


def test_script_load_exists_flush_and_evalsha(diff):
    sha = diff.both("SCRIPT", "LOAD", "return 'loaded'")
    scripts(diff, [
        ("EVALSHA", sha, "0"),
        ("EVALSHA", sha.upper(), "0"),
        ("EVALSHA_RO", sha, "0"),
        ("SCRIPT", "EXISTS", sha, "0000000000000000000000000000000000000000"),
        ("SCRIPT", "LOAD", "retur n"),
        ("SCRIPT", "FLUSH"),
        ("SCRIPT", "EXISTS", sha),
        ("EVALSHA", sha, "0"),
        ("SCRIPT", "FLUSH", "ASYNC"),
        ("SCRIPT", "FLUSH", "bogus"),
        ("SCRIPT", "KILL"),
    ])
    # EVAL caches its script too.
    diff.both("EVAL", "return 'by eval'", "0")
    scripts(diff, [("EVALSHA", "4e6d8fc8bb01276962cce5371fa795a7763657ae", "0")])


def test_redis_py_lock_under_contention(server):
    """redis-py's Lock: acquire, extend and release are Lua scripts. Threads increment a shared
    counter with a read, a pause and a write inside the lock: the total is exact only if the
    lock excludes."""
    setup = server.client()
    setup.set("locked:counter", 0)
    threads, rounds = 6, 15

    def work():
        client = server.client()
        lock = client.lock("lock:resource", timeout=10, blocking_timeout=30)
        for _ in range(rounds):
            assert lock.acquire()
            value = int(client.get("locked:counter"))
            time.sleep(0.001)
            client.set("locked:counter", value + 1)
            assert lock.extend(5)
            lock.release()
        client.close()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert not worker.is_alive()
    assert int(setup.get("locked:counter")) == threads * rounds
    # A lock held by another owner cannot be released.
    first = setup.lock("lock:other", timeout=5)
    assert first.acquire(blocking=False)
    second = server.client().lock("lock:other", timeout=5)
    assert not second.acquire(blocking=False)
    second.local.token = b"not-the-owner"
    with pytest.raises(redis.exceptions.LockNotOwnedError):
        second.release()
    first.release()
    setup.close()


def test_register_script_runs_by_sha_and_reloads_after_a_flush(r):
    add = r.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    assert add(keys=["total"], args=[5]) == 5
    assert add(keys=["total"], args=[7]) == 12
    r.script_flush()
    assert add(keys=["total"], args=[1]) == 13  # NOSCRIPT, then EVAL, as redis-py does


def same_shard_keys(client: redis.Redis, count: int, prefix: str) -> list[str]:
    """`count` keys in one shard: a script refuses keys of several shards (CROSSSLOT)."""
    keys = [f"{prefix}:0"]
    candidate = 1
    while len(keys) < count:
        key = f"{prefix}:{candidate}"
        candidate += 1
        try:
            client.eval("return 1", 2, keys[0], key)
        except redis.ResponseError as err:  # redis-py names CROSSSLOT ClusterCrossSlotError
            assert "same slot" in str(err), err
            continue
        keys.append(key)
    return keys


def test_scripts_over_several_shards_and_undeclared_keys_answer_as_redis(diff):
    # Keys on both shards, and keys a script names without declaring them (kombu's sweep does):
    # copse runs such a script optimistically over all shards (`scripts::spread`).
    keys = [f"spread:{i}" for i in range(8)]
    scripts(diff, [
        ("EVAL", "for i = 1, #KEYS do redis.call('SET', KEYS[i], i) end return redis.call('MGET', unpack(KEYS))",
         str(len(keys)), *keys),
        ("EVAL", "redis.call('SET', 'undeclared:a', ARGV[1]); redis.call('RPUSH', 'undeclared:b', ARGV[1]);"
                 " return {redis.call('GET', 'undeclared:a'), redis.call('LRANGE', 'undeclared:b', 0, -1)}",
         "0", "value"),
        ("MGET", *keys, "undeclared:a"),
        ("EVAL", "redis.call('DEL', KEYS[1]); return redis.call('INCR', KEYS[2])", "2", keys[0], "missing:c"),
        ("EVAL_RO", "return redis.call('SET', 'undeclared:c', 1)", "0"),
        ("EVAL", "redis.call('SET', KEYS[1], 'kept'); return redis.call('INCR', KEYS[2])", "2", keys[1], "undeclared:a"),
        ("GET", keys[1]),
    ])


def test_scripts_over_several_shards_never_show_part_of_a_transfer(server):
    """Scripts move amounts between accounts on both shards (optimistic, checked at commit);
    readers sum every account with MGET and with a script: the total never moves."""
    accounts = [f"acct:{i}" for i in range(12)]
    total = 100 * len(accounts)
    setup = server.client()
    setup.mset({account: 100 for account in accounts})
    transfer = ("local amount = tonumber(ARGV[1]);"
                " redis.call('DECRBY', KEYS[1], amount); redis.call('INCRBY', KEYS[2], amount); return 1")
    audit = "local sum = 0 for i = 1, #KEYS do sum = sum + tonumber(redis.call('GET', KEYS[i])) end return sum"
    stop = threading.Event()
    problems: list = []
    moves = [0]

    def writer(seed):
        client = server.client()
        rng = random.Random(seed)
        while not stop.is_set():
            source, target = rng.sample(accounts, 2)
            assert client.eval(transfer, 2, source, target, rng.randint(1, 9)) == 1
            moves[0] += 1
        client.close()

    def reader():
        client = server.client()
        while not stop.is_set():
            seen = sum(int(value) for value in client.mget(accounts))
            if seen != total:
                problems.append(f"MGET saw {seen}")
            seen = client.eval(audit, len(accounts), *accounts)
            if seen != total:
                problems.append(f"a script saw {seen}")
        client.close()

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(3)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(3)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    assert not problems, problems[:5]
    assert moves[0] > 30
    assert sum(int(value) for value in setup.mget(accounts)) == total
    setup.close()


def test_a_transaction_holding_a_script_runs_whole_and_honours_watch(diff):
    scripts(diff, [
        ("SET", "counter", "1"),
        ("MULTI",),
        ("SET", "t:a", "1"),
        ("EVAL", "return redis.call('INCR', KEYS[1]) + redis.call('INCR', KEYS[2])", "2", "t:a", "t:b"),
        ("GET", "t:a"),
        ("INCR", "counter"),
        ("EXEC",),
        ("WATCH", "counter"),
        ("SET", "counter", "10"),
        ("MULTI",),
        ("EVAL", "return redis.call('INCR', KEYS[1])", "1", "counter"),
        ("EXEC",),
        ("GET", "counter"),
    ])


def test_a_runaway_script_is_stopped_with_nothing_written(r):
    with pytest.raises(redis.ResponseError, match="ran longer than"):
        r.eval("redis.call('SET', KEYS[1], 'x'); while true do end", 1, "runaway")
    assert r.exists("runaway") == 0
    assert r.ping()


def test_a_killed_server_keeps_each_script_whole_or_not_at_all(make_server):
    """A script writes one token to 6 keys of one shard; the server is killed under writers
    running it. After each restart every writer's keys hold one token, at least the last one
    acknowledged."""
    server = make_server()
    probe = server.client()
    writers = 4
    groups = [same_shard_keys(probe, 6, f"script:{writer}") for writer in range(writers)]
    probe.close()
    body = "for i = 1, #KEYS do redis.call('SET', KEYS[i], ARGV[1]) end return #KEYS"

    def write_group(client, keys, token):
        assert client.eval(body, len(keys), *keys, token) == len(keys)

    assert_groups_survive_kills(server, groups, write_group, cycles=3, seed=3, what="script")


# Found by review (2026-11-29).

def test_the_sandbox_keeps_scripts_apart_and_refuses_bytecode(r):
    """Nothing a script does to its globals, `redis`, the libraries or the strings' metatable
    reaches the next script; loadstring refuses bytecode; getfenv and debug are not there."""
    assert r.eval("return tostring(loadstring(string.dump(function() return 1 end)))", 0) == b"nil"
    with pytest.raises(redis.ResponseError, match="readonly table"):
        r.eval("redis.call = function() return 'spy' end", 0)
    with pytest.raises(redis.ResponseError, match="readonly table"):
        r.eval("string.upper = nil", 0)
    r.eval("rawset(_G, 'type', function() return 'replaced' end) return 1", 0)
    assert r.eval("return type(1)", 0) == b"number"
    assert r.eval("return tostring(getmetatable(''))", 0) == b"false"
    assert r.eval("return {pcall(setmetatable, _G, nil)}", 0)[1] == b"cannot change a protected metatable"
    for name in ("getfenv", "setfenv", "debug", "load", "dofile", "require", "os", "io"):
        with pytest.raises(redis.ResponseError, match="nonexistent global"):
            r.eval(f"return {name}", 0)
    assert r.eval("return loadstring('return 40 + 2')()", 0) == 42
    assert r.eval("return redis.call('SET', KEYS[1], 'x')", 1, "after-sandbox") == b"OK"


def test_a_script_cannot_dodge_its_time_limit_with_pcall(r):
    with pytest.raises(redis.ResponseError, match="ran longer than"):
        r.eval("redis.call('SET', KEYS[1], 'x') while true do pcall(function() while true do end end) end",
               1, "dodger")
    assert r.exists("dodger") == 0
    assert r.ping()


def test_a_diverging_script_over_several_shards_keeps_only_its_last_run(r):
    # math.random differs between runs: the probes of an abandoned run must not count.
    script = """local n = math.random(1, 2)
        redis.call('SET', 'div:' .. n, 'x')
        redis.call('GET', 'other')
        return n"""
    for _ in range(30):
        r.delete("div:1", "div:2")
        r.eval(script, 0)
        assert r.exists("div:1", "div:2") == 1


def test_select_inside_a_spread_script_and_subscribe_from_a_script(r):
    r.eval("redis.call('SELECT', 1); redis.call('SET', 'in-db-1', 'v')", 0)
    assert r.exists("in-db-1") == 0
    r.execute_command("SELECT", 1)
    assert r.get("in-db-1") == b"v"
    r.execute_command("SELECT", 0)
    with pytest.raises(redis.ResponseError, match="not allowed from script"):
        r.eval("return redis.call('SUBSCRIBE', 'c')", 0)


def test_a_hash_expiring_under_a_spread_script_is_not_resurrected(r):
    script = """redis.call('HSET', 'eh', 'f', 'v')
        redis.call('PERSIST', 'eh')
        for i = 1, 1500 do redis.call('GET', 'pad' .. i) end
        return redis.call('HLEN', 'eh')"""
    for _ in range(2):
        r.delete("eh")
        r.hset("eh", mapping={"a": 1, "b": 2})
        r.pexpire("eh", 30)
        answered = r.eval(script, 0)
        assert answered == r.hlen("eh") == len(r.hgetall("eh")), (answered, r.hgetall("eh"))


def test_a_script_cannot_grow_the_server_without_bound(r):
    with pytest.raises(redis.ResponseError, match="not enough memory"):
        r.eval("return #string.rep('x', 2^27)", 0)
    r.set("one-mib", b"a" * (1 << 20))
    assert r.eval("return #redis.call('GET', KEYS[1])", 1, "one-mib") == 1 << 20
