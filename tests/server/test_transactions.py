"""Transactions (issue 24 item 1): MULTI, EXEC, DISCARD, WATCH and UNWATCH.

The differential tests send the same commands to copse and to redis-server and compare the
replies byte for byte, errors included; they cover Redis's own transaction tests (multi.tcl and
cas.tcl: queueing, EXECABORT, errors at run time, WATCH and what touches a watched key). Keys
are spread so that transactions span both shards. The tests with threads check what a
differential test cannot: that a transaction over several shards is seen whole or not at all by
other clients, that optimistic increments with WATCH lose nothing under contention, and (kill
test) that a crash keeps all of a transaction or none of it.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import redis

from support import Differential, assert_groups_survive_kills
from support import run_script as run_commands

# Kill cycles of the crash test (`make torture` may ask for more).
KILL_CYCLES = int(os.environ.get("COPSE_TXN_KILL_CYCLES", "3"))


def run_script(diff: Differential, script: str) -> None:
    run_commands(diff, script, frozenset({"SMEMBERS", "HGETALL", "KEYS"}))


def test_queued_commands_run_at_exec_in_order_over_every_type(diff):
    run_script(diff, """
        MULTI
        SET a 1
        INCR a
        INCRBY a 10
        GET a
        SET b x
        APPEND b yz
        MSET m1 1 m2 2 m3 3 m4 4 m5 5
        MGET m1 m2 m3 m4 m5 nope
        RPUSH l a b c
        LPOP l
        LRANGE l 0 -1
        HSET h f1 v1 f2 v2
        HINCRBY h n 5
        HGET h f2
        SADD s x y z
        SREM s y
        SCARD s
        ZADD z 1 a 2 b 3 c
        ZINCRBY z 10 a
        ZRANGE z 0 -1 WITHSCORES
        DEL m1 m2 m3 nope
        EXISTS m1 m4 m5 a b
        EXPIRE a 1000
        TTL a
        EXEC
        MGET a b m1 m4
        LRANGE l 0 -1
        HGETALL h
        SMEMBERS s
        ZRANGE z 0 -1 WITHSCORES
        TTL a
    """)


def test_a_transaction_sees_its_own_writes_and_deletes(diff):
    run_script(diff, """
        RPUSH l1 a b
        HSET h f v
        MULTI
        DEL l1
        LLEN l1
        RPUSH l1 new
        LRANGE l1 0 -1
        HDEL h f
        HLEN h
        HGETALL h
        EXISTS h
        SET h now-a-string
        GET h
        TYPE h
        EXEC
        TYPE h
        LRANGE l1 0 -1
    """)


def test_discard_and_the_errors_of_misplaced_commands(diff):
    run_script(diff, """
        RPUSH mylist a b c
        MULTI
        DEL mylist
        DISCARD
        LRANGE mylist 0 -1
        EXEC
        DISCARD
        MULTI
        MULTI
        WATCH x
        PING
        EXEC
        MULTI
        EXEC
    """)


def test_errors_while_queueing_abort_the_exec_and_nothing_runs(diff):
    run_script(diff, """
        DEL foo1 foo2
        MULTI
        SET foo1 bar1
        NON-EXISTING-COMMAND
        SET foo2 bar2
        EXEC
        EXISTS foo1 foo2
        MULTI
        SET foo1 bar1
        GET
        SET foo2 bar2
        EXEC
        EXISTS foo1 foo2
        GET foo1
        MULTI
        PING
        EXEC
    """)


def test_errors_at_run_time_are_in_the_reply_and_the_rest_applies(diff):
    run_script(diff, """
        SET str hello
        RPUSH lst a
        MULTI
        SET before 1
        LPUSH str x
        INCR str
        HSET lst f v
        SET after 2
        INCR after
        EXEC
        MGET before after str
        LRANGE lst 0 -1
    """)


def test_replies_in_resp2_and_resp3(diff23):
    run_script(diff23, """
        MULTI
        SET k v
        GET nothing
        HSET h a 1
        HGETALL h
        ZADD z 1.5 m
        ZSCORE z m
        SMEMBERS none
        EXEC
        WATCH k
        SET k w
        MULTI
        GET k
        EXEC
    """)


def test_select_inside_multi_changes_the_database_of_the_commands_after_it(diff):
    run_script(diff, """
        MULTI
        SET k db0
        SELECT 3
        SET k db3
        GET k
        SELECT 0
        GET k
        EXEC
        GET k
        SELECT 3
        GET k
        SELECT 0
    """)


# WATCH: Redis's cas.tcl, in both servers.

def test_exec_runs_when_no_watched_key_changed(diff):
    run_script(diff, """
        WATCH x y z
        WATCH k
        MULTI
        PING
        EXEC
    """)


def test_exec_fails_when_a_watched_key_changed(diff):
    run_script(diff, """
        SET x 30
        WATCH x
        SET x 40
        MULTI
        PING
        EXEC
        SET x 30
        WATCH a b x k z
        SET x 40
        MULTI
        PING
        EXEC
        WATCH a b x k z
        DEL x
        MULTI
        SET x 1
        EXEC
        GET x
        WATCH hashkey
        HSET hashkey f v
        MULTI
        PING
        EXEC
    """)


def test_a_key_is_no_longer_watched_after_exec_discard_or_unwatch(diff):
    run_script(diff, """
        SET x 30
        WATCH x
        MULTI
        PING
        EXEC
        SET x 40
        MULTI
        PING
        EXEC
        WATCH x
        SET x 40
        MULTI
        PING
        EXEC
        SET x 40
        MULTI
        PING
        EXEC
        WATCH x
        SET x 30
        UNWATCH
        MULTI
        PING
        EXEC
        UNWATCH
        WATCH x
        SET x 10
        MULTI
        DISCARD
        MULTI
        INCR x
        EXEC
    """)


def test_flushall_and_flushdb_touch_watched_keys_that_existed(diff):
    run_script(diff, """
        SET x 30
        WATCH x
        FLUSHALL
        MULTI
        PING
        EXEC
        DEL x
        WATCH x
        FLUSHALL
        MULTI
        PING
        EXEC
        SET x 30
        WATCH x
        FLUSHDB
        MULTI
        PING
        EXEC
        DEL x
        WATCH x
        FLUSHDB
        MULTI
        PING
        EXEC
    """)


def test_a_watched_key_that_expires_fails_the_exec_and_a_stale_one_does_not(diff):
    run_script(diff, "SET x foo PX 200\nWATCH x")
    time.sleep(0.4)
    run_script(diff, """
        MULTI
        PING
        EXEC
        SET y foo PX 1
    """)
    time.sleep(0.05)
    run_script(diff, """
        WATCH y
        MULTI
        PING
        EXEC
        SET z foo
        WATCH z
        EXPIRE z 100
        MULTI
        PING
        EXEC
    """)


def test_swapdb_fails_a_watch(diff):
    run_script(diff, """
        SET x 1
        WATCH x
        SWAPDB 0 1
        MULTI
        PING
        EXEC
        SWAPDB 0 1
    """)


# Found by review (2026-11-29).

def test_an_exec_that_does_not_run_leaves_the_connection_in_its_database(diff):
    run_script(diff, """
        SET x 1
        WATCH x
        SET x 2
        MULTI
        SELECT 5
        SET k in-five
        EXEC
        SET k2 still-zero
        GET k2
        SELECT 5
        GET k2
        GET k
        SELECT 0
        MULTI
        SELECT 5
        EXEC
        SET k3 now-five
        SELECT 0
        GET k3
        SELECT 5
        GET k3
        SELECT 0
    """)


def test_a_wrong_arity_of_exec_discard_or_multi_inside_multi_aborts_it(diff):
    run_script(diff, """
        MULTI
        SET a 1
        EXEC foo
        EXEC
        GET a
        MULTI
        SET a 1
        DISCARD x
        EXEC
        MULTI
        MULTI x
        SET a 1
        EXEC
        GET a
    """)


def test_time_stands_still_inside_exec(diff):
    # Redis reads the clock once for a transaction: a 1 ms expiry set in it has not passed
    # for the commands after it, however long they take.
    incrs = "\n".join("INCR busy" for _ in range(3000))
    run_script(diff, f"""
        MULTI
        SET k v PX 1
        {incrs}
        GET k
        EXEC
    """.replace("INCR busy\n", "INCR busy\n        "))


def test_reads_and_other_keys_written_by_a_transaction_fail_no_watch(server):
    """A transaction that only reads x (and writes y beside it in the same shard) does not fail
    another client's WATCH of x; nor does an expired key deleted by active expiry."""
    first, second = server.client(), server.client()
    second.set("stale", "v", px=1)
    first.set("x", 1)
    for round_ in range(20):
        first.watch("x", "stale")
        assert first.get("x") is not None
        pipe = second.pipeline(transaction=True)
        pipe.get("x")
        pipe.set(f"y:{round_}", round_)
        pipe.execute()
        time.sleep(0.02)
        pipe = first.pipeline(transaction=True)
        pipe.set("x", round_)
        # redis-py's pipeline carries the WATCH of `first` only through its own connection:
        # send the transaction by hand on it.
        first.execute_command("MULTI")
        first.execute_command("SET", "x", round_)
        assert first.execute_command("EXEC") == [b"OK"], f"round {round_}: the WATCH failed"
    first.close()
    second.close()


def test_connection_state_commands_are_refused_inside_multi(r):
    for refused in (("CLIENT", "SETNAME", "n"), ("CONFIG", "SET", "timeout", "5"), ("HELLO", "3")):
        pipe = r.pipeline(transaction=True)
        pipe.set("untouched", 1)
        pipe.execute_command(*refused)
        with pytest.raises(redis.ResponseError, match="cannot run inside MULTI"):
            pipe.execute()
    assert r.exists("untouched") == 0


# What copse refuses inside MULTI (Redis runs these): the refusal aborts the EXEC.

def test_commands_that_would_run_in_steps_of_their_own_are_refused_and_abort_the_exec(r):
    for refused in (("KEYS", "*"), ("BLPOP", "l", "0"), ("SCAN", "0"), ("FLUSHALL",), ("SUBSCRIBE", "c")):
        pipe = r.pipeline(transaction=True)
        pipe.set("kept-out", "1")
        pipe.execute_command(*refused)
        pipe.set("kept-out-too", "1")
        with pytest.raises(redis.ResponseError, match="cannot run inside MULTI"):
            pipe.execute()
        assert r.exists("kept-out", "kept-out-too") == 0


# Real clients, several connections.

def test_optimistic_increments_with_watch_lose_nothing(server):
    """redis-py's transaction(): WATCH, GET, MULTI, SET, EXEC, retried on WatchError."""
    threads, increments = 8, 50
    first = server.client()
    first.delete("counter")
    retries = [0]

    def work():
        client = server.client()

        def increment(pipe):
            value = int(pipe.get("counter") or 0)
            pipe.multi()
            pipe.set("counter", value + 1)

        for _ in range(increments):
            client.transaction(increment, "counter")
        client.close()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert not worker.is_alive()
    assert int(first.get("counter")) == threads * increments
    first.close()


def test_other_clients_never_see_part_of_a_transaction_over_several_shards(server):
    """Writers move amounts between accounts in transactions (keys on both shards); readers
    read every account in one MGET and in one MULTI ... EXEC of GETs: the total never moves."""
    accounts = [f"account:{i}" for i in range(16)]
    total = 1000 * len(accounts)
    setup = server.client()
    setup.mset({account: 1000 for account in accounts})
    stop = threading.Event()
    problems: list = []
    transfers = [0]

    def writer(seed):
        client = server.client()
        rng = random.Random(seed)
        while not stop.is_set():
            source, target = rng.sample(accounts, 2)
            amount = rng.randint(1, 50)
            pipe = client.pipeline(transaction=True)
            pipe.decrby(source, amount)
            pipe.incrby(target, amount)
            pipe.execute()
            transfers[0] += 1
        client.close()

    def reader():
        client = server.client()
        while not stop.is_set():
            seen = sum(int(value) for value in client.mget(accounts))
            if seen != total:
                problems.append(f"MGET saw a total of {seen}")
            pipe = client.pipeline(transaction=True)
            for account in accounts:
                pipe.get(account)
            seen = sum(int(value) for value in pipe.execute())
            if seen != total:
                problems.append(f"MULTI of GETs saw a total of {seen}")
        client.close()

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(4)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(4)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    assert not problems, problems[:5]
    assert transfers[0] > 50, f"only {transfers[0]} transfers ran"
    assert sum(int(value) for value in setup.mget(accounts)) == total
    setup.close()


def test_del_and_exists_of_keys_on_several_shards_are_atomic(server):
    """DEL of several keys (issue 24 item 2) is one cross-shard batch: readers see all 16 keys
    or none of them, by MGET and by EXISTS, while a writer sets them with MSET and deletes them
    with DEL (or UNLINK) over and over."""
    keys = [f"group:{i}" for i in range(16)]
    stop = threading.Event()
    problems: list = []
    rounds = [0]

    def writer():
        client = server.client()
        while not stop.is_set():
            client.mset({key: rounds[0] for key in keys})
            if rounds[0] % 2:
                assert client.delete(*keys) == len(keys)
            else:
                assert client.unlink(*keys) == len(keys)
            rounds[0] += 1
        client.close()

    def reader():
        client = server.client()
        while not stop.is_set():
            present = sum(value is not None for value in client.mget(keys))
            if present not in (0, len(keys)):
                problems.append(f"MGET saw {present} of {len(keys)} keys")
            counted = client.exists(*keys)
            if counted not in (0, len(keys)):
                problems.append(f"EXISTS counted {counted} of {len(keys)} keys")
        client.close()

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(3)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    assert not problems, problems[:5]
    assert rounds[0] > 20, f"only {rounds[0]} rounds ran"


def test_a_killed_server_keeps_each_transaction_whole_or_not_at_all(make_server):
    """Writers each write one token to their own 8 keys (over both shards) in transactions; the
    server is killed under them. After each restart every writer's keys hold one token, at
    least the last one it saw acknowledged."""
    server = make_server()
    writers = 6
    groups = [[f"tx:{writer}:{i}" for i in range(8)] for writer in range(writers)]

    def write_group(client, keys, token):
        pipe = client.pipeline(transaction=True)
        for key in keys:
            pipe.set(key, token)
        pipe.execute()

    assert_groups_survive_kills(server, groups, write_group, KILL_CYCLES, seed=24, what="transaction")
