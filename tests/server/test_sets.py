"""Sets (issue 23 item 4; docs/format/redis-keyspace.md, "Sets"): SADD, SREM, SISMEMBER,
SMISMEMBER, SMEMBERS, SCARD, SPOP, SRANDMEMBER, SMOVE, SSCAN, SINTER/SUNION/SDIFF (+STORE) and
SINTERCARD.

The differential tests send the same commands to copse and to redis-server (installed by `make
test-deps`) and compare the replies, errors included; a reply whose order neither server
promises (SMEMBERS, SINTER, ...) is compared sorted. SPOP and SRANDMEMBER are random: tested by
their properties.
"""

from __future__ import annotations

import random
import time

import pytest
import redis

from support import Differential
from support import run_script as run_commands

UNORDERED = {"SMEMBERS", "SINTER", "SUNION", "SDIFF", "SSCAN"}


def run_script(diff: Differential, script: str) -> None:
    run_commands(diff, script, UNORDERED)


def test_set_commands_and_errors_answer_as_redis_does(diff):
    run_script(diff, """
        SADD s a b c
        SADD s a d
        SADD s
        SCARD s
        SCARD nokey
        SISMEMBER s a
        SISMEMBER s z
        SISMEMBER nokey a
        SMISMEMBER s a z b
        SMISMEMBER nokey a
        SMEMBERS s
        SMEMBERS nokey
        SREM s a z
        SREM nokey a
        SREM s b c d
        EXISTS s
        SADD s1 a b c d
        SADD s2 c d e
        SADD s3 d e f
        SINTER s1 s2
        SINTER s1 s2 s3
        SINTER s1 nokey
        SINTER nokey s1
        SUNION s1 s2 s3
        SUNION nokey
        SDIFF s1 s2
        SDIFF s1 s2 s3
        SDIFF nokey s1
        SINTERSTORE d1 s1 s2
        SMEMBERS d1
        SUNIONSTORE d1 s1 s3
        SCARD d1
        SDIFFSTORE d1 s1 s2 s3
        SMEMBERS d1
        SINTERSTORE d1 s1 nokey
        EXISTS d1
        SET str x
        SINTERSTORE str s1 s2
        TYPE str
        SINTER s1 str
        SINTER nokey str
        SUNION s1 str
        SDIFF str s1
        SDIFFSTORE d2 s1 str
        SINTERCARD 2 s1 s2
        SINTERCARD 2 s1 s2 LIMIT 1
        SINTERCARD 2 s1 s2 LIMIT 0
        SINTERCARD 0 s1
        SINTERCARD 3 s1 s2
        SINTERCARD 2 s1 s2 LIMIT -1
        SINTERCARD 2 s1 s2 FOO 1
        SINTERCARD 2 s1 s2 LIMIT x
        SINTERCARD abc s1
        SINTERCARD 1 str
        SMOVE s1 s2 a
        SMOVE s1 s2 a
        SMOVE s1 s2 c
        SMOVE s1 s1 b
        SMOVE s1 s1 zz
        SMOVE nokey s2 a
        SMOVE nokey str a
        SMOVE str s1 a
        SMOVE s1 str b
        SMOVE s1 str zz
        SMOVE s1 new b
        SMEMBERS s1
        SMEMBERS s2
        SMEMBERS new
        SADD str a
        SCARD str
        SMEMBERS str
        SISMEMBER str a
        SSCAN str 0
        SADD one x
        SRANDMEMBER one
        SRANDMEMBER one 5
        SRANDMEMBER one -2
        SPOP one
        EXISTS one
        SPOP nokey
        SPOP nokey 3
        SPOP s2 -1
        SPOP s2 0
        SRANDMEMBER nokey
        SRANDMEMBER nokey 3
        SRANDMEMBER nokey -3
        SRANDMEMBER s2 0
        SRANDMEMBER s2 abc
        SPOP s2 1 2
        SSCAN nokey 0
        SSCAN s2 abc
        SSCAN nokey 0 COUNT 0
        SSCAN s2 0 MATCH
    """)


def random_command(rng: random.Random) -> list[str]:
    keys = ["s1", "s2", "s3", "x9", "str"]
    key, other = rng.choice(keys), rng.choice(keys)
    members = lambda: [rng.choice("abcdefg") for _ in range(rng.randint(1, 4))]  # noqa: E731
    choices = [
        lambda: ["SADD", key] + members(),
        lambda: ["SREM", key] + members(),
        lambda: ["SISMEMBER", key, rng.choice("abcdefg")],
        lambda: ["SMISMEMBER", key] + members(),
        lambda: ["SMEMBERS", key],
        lambda: ["SCARD", key],
        lambda: ["SMOVE", key, other, rng.choice("abcdefg")],
        lambda: ["SINTER", key, other],
        lambda: ["SUNION", key, other, rng.choice(keys)],
        lambda: ["SDIFF", key, other],
        lambda: ["SINTERSTORE", rng.choice(keys), key, other],
        lambda: ["SUNIONSTORE", rng.choice(keys), key, other],
        lambda: ["SDIFFSTORE", rng.choice(keys), key, other],
        lambda: ["SINTERCARD", "2", key, other],
        lambda: ["SPOP", key, "100"],
        lambda: ["SET", "str", "v"],
        lambda: ["DEL", key],
        lambda: ["TYPE", key],
    ]
    return rng.choice(choices)()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_set_commands_answer_as_redis_does(diff, seed):
    """3,000 random set commands over five keys (one a string; pairs in one shard and across
    shards for SMOVE and the STORE forms), each compared with redis-server's reply."""
    rng = random.Random(seed)
    for _ in range(3_000):
        command = random_command(rng)
        diff.both(*command, unordered=command[0] in UNORDERED or command[0] == "SPOP")
    for key in ["s1", "s2", "s3", "x9", "str"]:
        if diff.both("TYPE", key) == b"set":
            diff.both("SMEMBERS", key, unordered=True)


def test_spop_and_srandmember_pick_members_at_random(r):
    members = {f"m{i}".encode() for i in range(200)}
    r.sadd("s", *members)
    picks = [r.srandmember("s") for _ in range(400)]
    assert set(picks) <= members and len(set(picks)) > 50, "SRANDMEMBER is not random enough"
    distinct = r.srandmember("s", 50)
    assert len(distinct) == 50 and len(set(distinct)) == 50 and set(distinct) <= members
    assert len(r.srandmember("s", 500)) == 200, "a count over the size gives every member once"
    repeated = r.srandmember("s", -300)
    assert len(repeated) == 300 and set(repeated) <= members
    popped = set(r.spop("s", 30))
    assert len(popped) == 30 and popped <= members
    assert r.scard("s") == 170 and not (popped & set(r.smembers("s")))
    one = r.spop("s")
    assert one in members - popped and r.scard("s") == 169
    rest = set(r.spop("s", 1_000))
    assert rest | popped | {one} == members and r.exists("s") == 0


def test_sscan_returns_every_member_once_over_its_cursor(r):
    members = {f"member:{i}".encode() for i in range(3_000)}
    r.sadd("big", *members)
    seen = []
    cursor = 0
    while True:
        cursor, page = r.sscan("big", cursor, count=100)
        seen += page
        if cursor == 0:
            break
    assert sorted(seen) == sorted(members)
    assert set(r.sscan_iter("big", match="member:1??")) == {m for m in members if len(m) == 10 and m.startswith(b"member:1")}


def test_a_large_set_is_deleted_in_one_small_write(r):
    """DEL of a 30,000-member set writes two items; the collector deletes the members."""
    pipe = r.pipeline(transaction=False)
    for start in range(0, 30_000, 1_000):
        pipe.sadd("huge", *[f"m{i}" for i in range(start, start + 1_000)])
    pipe.execute()
    assert r.scard("huge") == 30_000
    assert r.delete("huge") == 1 and r.exists("huge") == 0 and r.smembers("huge") == set()
    deadline = time.monotonic() + 60
    while int(r.info("copse")["items"]) != 1:
        assert time.monotonic() < deadline, r.info("copse")
        time.sleep(0.05)
