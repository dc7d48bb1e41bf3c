"""Sorted set commands of `copse serve`, through redis-py in RESP2 and RESP3 (`rc` runs a test
in both; `r` is RESP2 only, for tests whose replies do not depend on the protocol).

Expectations follow Redis 7.2's documentation: scores are doubles (RESP3 double replies, RESP2
bulk strings), members of equal score are ordered by their bytes, and copse's own limits
(key + member length, members per set) are in docs/server.md.
"""

from __future__ import annotations

import math
import random
import threading

import pytest
import redis

from support import assert_store_checks, raw_command, run_clients

WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
# Members of the large sets below: more than one atomic batch could delete (10,000 items).
ZSET_MEMBERS = 12_000
KEY_AND_MEMBER_BYTES_MAX = 1002  # item key 1024 - MEMBER_OVERHEAD_BYTES 22
INF = math.inf


def pairs(reply) -> list[tuple[bytes, float]]:
    """redis-py's WITHSCORES answer (tuples in RESP2, lists in RESP3) as (member, score) tuples."""
    return [(member, score) for member, score in reply]


def zadd_args(mapping: dict) -> list:
    out = []
    for member, score in mapping.items():
        out += [score, member]
    return out


def ordered(model: dict) -> list[tuple[bytes, float]]:
    """A model's members in sorted set order: by score, then by member bytes."""
    return sorted(model.items(), key=lambda item: (item[1], item[0]))


@pytest.fixture
def board(rc):
    """A small set with ties: (a, b, c at 1), d at 2, e at 3.5, f at 10."""
    rc.zadd("z", {"c": 1, "a": 1, "b": 1, "d": 2, "e": 3.5, "f": 10})
    return rc


# -- ZADD and its options ----------------------------------------------------------------------


def test_zadd_counts_new_members(rc):
    assert rc.zadd("z", {"a": 1, "b": 2}) == 2
    assert rc.zadd("z", {"a": 5, "c": 3}) == 1, "an update is not counted without CH"
    assert rc.zscore("z", "a") == 5.0
    assert rc.zadd("z", {"a": 5}) == 0
    # A member named twice: the pairs apply in order, the last score wins.
    assert rc.execute_command("ZADD", "z", "1", "d", "7", "d") == 1
    assert rc.zscore("z", "d") == 7.0
    assert rc.zcard("z") == 4
    assert rc.type("z") == b"zset"
    assert rc.exists("z") == 1


def test_zadd_nx_xx(rc):
    assert rc.zadd("z", {"a": 1}, xx=True) == 0
    assert rc.exists("z") == 0, "ZADD XX creates no key"
    assert rc.zadd("z", {"a": 1, "b": 2}, nx=True) == 2
    assert rc.zadd("z", {"a": 10, "c": 3}, nx=True) == 1
    assert rc.zscore("z", "a") == 1.0, "NX never updates"
    assert rc.zadd("z", {"a": 10, "d": 4}, xx=True) == 0
    assert rc.zscore("z", "a") == 10.0, "XX updates"
    assert rc.zscore("z", "d") is None, "XX never adds"
    assert rc.zadd("z", {"a": 11, "b": 2, "e": 5}, xx=True, ch=True) == 1


def test_zadd_gt_lt(rc):
    rc.zadd("z", {"a": 5, "b": 5})
    assert rc.zadd("z", {"a": 3, "b": 7}, gt=True, ch=True) == 1
    assert (rc.zscore("z", "a"), rc.zscore("z", "b")) == (5.0, 7.0)
    assert rc.zadd("z", {"a": 3, "b": 9}, lt=True, ch=True) == 1
    assert (rc.zscore("z", "a"), rc.zscore("z", "b")) == (3.0, 7.0)
    # GT and LT do not stop new members.
    assert rc.zadd("z", {"c": 1}, gt=True) == 1
    assert rc.zadd("z", {"d": 100}, lt=True) == 1
    # Equal scores are neither greater nor less.
    assert rc.zadd("z", {"a": 3}, gt=True, ch=True) == 0
    assert rc.zadd("z", {"a": 3}, lt=True, ch=True) == 0
    # XX with GT: update only, and only upwards.
    assert rc.zadd("z", {"a": 4, "new": 1}, xx=True, gt=True, ch=True) == 1
    assert rc.zscore("z", "a") == 4.0
    assert rc.zscore("z", "new") is None


def test_zadd_ch_counts_added_and_changed(rc):
    rc.zadd("z", {"a": 1, "b": 2})
    assert rc.zadd("z", {"a": 1, "b": 3, "c": 4}, ch=True) == 2, "b changed, c added, a same"
    assert rc.zadd("z", {"a": 1}, ch=True) == 0
    # Pairs apply one by one: a member added then changed in one ZADD counts twice with CH, and
    # one changed and changed back counts two changes though its score ends where it was.
    assert rc.execute_command("ZADD", "z", "CH", "1", "x", "2", "x") == 2
    assert rc.execute_command("ZADD", "z", "CH", "5", "x", "2", "x") == 2
    assert rc.execute_command("ZADD", "z", "5", "x", "2", "x") == 0
    assert rc.zscore("z", "x") == 2.0
    assert rc.zcard("z") == 4


def test_zadd_incr(rc):
    assert rc.zadd("z", {"a": 1.5}, incr=True) == 1.5
    assert rc.zadd("z", {"a": 2}, incr=True) == 3.5
    assert rc.zadd("z", {"a": 1}, incr=True, nx=True) is None, "NX: no increment of a member"
    assert rc.zadd("z", {"b": 1}, incr=True, xx=True) is None, "XX: no new member"
    assert rc.zscore("z", "b") is None
    assert rc.zadd("z", {"a": -1}, incr=True, gt=True) is None, "GT blocks a decrease: nil"
    assert rc.zadd("z", {"a": 1}, incr=True, lt=True) is None
    assert rc.zadd("z", {"a": 1}, incr=True, gt=True) == 4.5
    assert rc.zscore("z", "a") == 4.5
    assert rc.zadd("z", {"new": 2}, incr=True, nx=True) == 2.0


def test_zadd_incr_reply_is_a_double(rc):
    reply = raw_command(rc, "ZADD", "z", "INCR", "2.5", "a")
    assert reply == (2.5 if rc.protocol_version == 3 else b"2.5")
    assert raw_command(rc, "ZADD", "z", "XX", "INCR", "1", "missing") is None


@pytest.mark.parametrize(
    "args,message",
    [
        (("NX", "XX", "1", "a"), "XX and NX options at the same time are not compatible"),
        (("XX", "NX", "1", "a"), "XX and NX options at the same time are not compatible"),
        (("GT", "LT", "1", "a"), "GT, LT, and/or NX options at the same time are not compatible"),
        (("NX", "GT", "1", "a"), "GT, LT, and/or NX options at the same time are not compatible"),
        (("LT", "NX", "1", "a"), "GT, LT, and/or NX options at the same time are not compatible"),
        (("INCR", "1", "a", "2", "b"), "INCR option supports a single increment-element pair"),
        (("1", "a", "2"), "syntax error"),
        (("NX", "1"), "syntax error"),
        (("1", "a", "BOGUS", "b"), "value is not a valid float"),
        (("abc", "a"), "value is not a valid float"),
        (("nan", "a"), "value is not a valid float"),
        (("1", "a", "NaN", "b"), "value is not a valid float"),
        (("", "a"), "value is not a valid float"),
        (("1e400", "a"), "value is not a valid float"),
    ],
)
def test_zadd_errors_change_nothing(rc, args, message):
    rc.zadd("z", {"a": 7})
    with pytest.raises(redis.ResponseError, match=message):
        rc.execute_command("ZADD", "z", *args)
    with pytest.raises(redis.ResponseError, match=message):
        rc.execute_command("ZADD", "fresh", *args)
    assert pairs(rc.zrange("z", 0, -1, withscores=True)) == [(b"a", 7.0)]
    assert rc.exists("fresh") == 0


def test_zadd_arity(rc):
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'zadd' command"):
        rc.execute_command("ZADD", "z", "1")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'zadd' command"):
        rc.execute_command("ZADD", "z", "NX")


# -- ZINCRBY, ZREM, ZSCORE, ZMSCORE, ZCARD -----------------------------------------------------


def test_zincrby(rc):
    assert rc.zincrby("z", 2, "a") == 2.0, "a missing key and member start at 0"
    assert rc.zincrby("z", -0.5, "a") == 1.5
    assert rc.zincrby("z", 1, "b") == 1.0
    assert pairs(rc.zrange("z", 0, -1, withscores=True)) == [(b"b", 1.0), (b"a", 1.5)]
    reply = raw_command(rc, "ZINCRBY", "z", "1", "a")
    assert reply == (2.5 if rc.protocol_version == 3 else b"2.5")
    with pytest.raises(redis.ResponseError, match="value is not a valid float"):
        rc.execute_command("ZINCRBY", "z", "x", "a")
    with pytest.raises(redis.ResponseError, match="value is not a valid float"):
        rc.execute_command("ZINCRBY", "z", "nan", "a")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'zincrby' command"):
        rc.execute_command("ZINCRBY", "z", "1")
    assert rc.zscore("z", "a") == 2.5


def test_zrem(rc):
    assert rc.zrem("missing", "a") == 0
    rc.zadd("z", {"a": 1, "b": 2, "c": 3})
    assert rc.zrem("z", "a", "x", "a") == 1, "a missing member or a repeat counts nothing"
    assert rc.zscore("z", "a") is None
    assert rc.zcard("z") == 2
    assert rc.zrange("z", 0, -1) == [b"b", b"c"]
    assert rc.zrem("z", "b", "c") == 2
    assert rc.exists("z") == 0, "a sorted set goes with its last member"
    assert rc.type("z") == b"none"
    assert rc.zcard("z") == 0
    assert rc.zrange("z", 0, -1) == []
    assert rc.zadd("z", {"n": 1}) == 1
    assert pairs(rc.zrange("z", 0, -1, withscores=True)) == [(b"n", 1.0)]


def test_zscore_zmscore_zcard(rc):
    assert rc.zscore("missing", "a") is None
    assert rc.zmscore("missing", ["a", "b"]) == [None, None]
    assert rc.zcard("missing") == 0
    rc.zadd("z", {"a": 1.5, "b": -2, "c": 0})
    assert rc.zscore("z", "a") == 1.5
    assert rc.zscore("z", "b") == -2.0
    assert rc.zscore("z", "nope") is None
    assert rc.zmscore("z", ["a", "nope", "b", "a"]) == [1.5, None, -2.0, 1.5]
    assert rc.zcard("z") == 3
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'zmscore' command"):
        rc.execute_command("ZMSCORE", "z")


def test_score_replies_are_doubles_in_resp3_and_bulk_strings_in_resp2(rc):
    rc.zadd("z", {"a": 1.5, "b": 2, "c": INF, "d": -INF, "e": 0.1, "f": -3.25})
    resp3 = rc.protocol_version == 3

    def double(value: float, text: bytes):
        return value if resp3 else text

    expected = {"a": (1.5, b"1.5"), "b": (2.0, b"2"), "c": (INF, b"inf"), "d": (-INF, b"-inf"),
                "e": (0.1, b"0.1"), "f": (-3.25, b"-3.25")}
    for member, (value, text) in expected.items():
        assert raw_command(rc, "ZSCORE", "z", member) == double(value, text), member
    assert raw_command(rc, "ZSCORE", "z", "nope") is None
    assert raw_command(rc, "ZMSCORE", "z", "a", "nope") == [double(1.5, b"1.5"), None]
    # WITHSCORES: [member, score] pairs in RESP3, a flat array in RESP2.
    reply = raw_command(rc, "ZRANGE", "z", "0", "2", "WITHSCORES")
    if resp3:
        assert reply == [[b"d", -INF], [b"f", -3.25], [b"e", 0.1]]
    else:
        assert reply == [b"d", b"-inf", b"f", b"-3.25", b"e", b"0.1"]
    for command in (("ZRANGEBYSCORE", "z", "1", "2", "WITHSCORES"),
                    ("ZREVRANGEBYSCORE", "z", "2", "1", "WITHSCORES"),
                    ("ZREVRANGE", "z", "1", "2", "WITHSCORES"),
                    ("ZRANGE", "z", "1", "2", "BYSCORE", "WITHSCORES")):
        reply = raw_command(rc, *command)
        want = [(b"a", 1.5), (b"b", 2.0)]
        if command[0].startswith("ZREV"):
            want.reverse()
        if resp3:
            assert reply == [[m, s] for m, s in want], command
        else:
            assert reply == [x for m, s in want for x in (m, format_score(s))], command
    # ZRANK WITHSCORE: [rank, score].
    assert raw_command(rc, "ZRANK", "z", "a", "WITHSCORE") == [3, double(1.5, b"1.5")]
    assert raw_command(rc, "ZREVRANK", "z", "a", "WITHSCORE") == [2, double(1.5, b"1.5")]


def format_score(score: float) -> bytes:
    return (b"%d" % score) if score == int(score) else repr(score).encode()


# -- ZCOUNT and ranges -------------------------------------------------------------------------


def test_zcount(board):
    assert board.zcount("z", "-inf", "+inf") == 6
    assert board.zcount("z", 1, 2) == 4
    assert board.zcount("z", "(1", 2) == 1
    assert board.zcount("z", "(1", "(2") == 0
    assert board.zcount("z", 1, "(3.5") == 4
    assert board.zcount("z", "(2", "+inf") == 2
    assert board.zcount("z", 3, 1) == 0
    assert board.zcount("z", 1, 1) == 3
    assert board.zcount("missing", "-inf", "+inf") == 0
    with pytest.raises(redis.ResponseError, match="min or max is not a float"):
        board.zcount("z", "one", 2)
    with pytest.raises(redis.ResponseError, match="min or max is not a float"):
        board.zcount("z", 1, "nan")


def test_ties_are_ordered_by_member_bytes(rc):
    members = [b"b", b"a", b"ab", b"", b"\x00", b"\xff", b"B", b"a\x00", b"\x7f", b"\x80"]
    rc.zadd("z", {m: 5 for m in members})
    assert rc.zrange("z", 0, -1) == sorted(members)
    assert rc.zrevrange("z", 0, -1) == sorted(members, reverse=True)
    assert rc.zrangebyscore("z", 5, 5) == sorted(members)
    for rank, member in enumerate(sorted(members)):
        assert rc.zrank("z", member) == rank
        assert rc.zrevrank("z", member) == len(members) - 1 - rank


def test_zrange_by_rank(board):
    everything = [b"a", b"b", b"c", b"d", b"e", b"f"]
    assert board.zrange("z", 0, -1) == everything
    assert board.zrange("z", 0, 1) == [b"a", b"b"]
    assert board.zrange("z", -2, -1) == [b"e", b"f"]
    assert board.zrange("z", 2, -3) == [b"c", b"d"]
    assert board.zrange("z", -100, 100) == everything
    assert board.zrange("z", 4, 2) == []
    assert board.zrange("z", 6, 10) == []
    assert board.zrange("z", 0, -7) == []
    assert board.zrange("z", -1, -1) == [b"f"]
    assert board.zrange("missing", 0, -1) == []
    assert board.zrange("z", -9223372036854775808, 9223372036854775807) == everything
    assert pairs(board.zrange("z", 3, 5, withscores=True)) == [(b"d", 2.0), (b"e", 3.5), (b"f", 10.0)]
    # REV: ranks count from the highest score.
    assert board.zrange("z", 0, 1, desc=True) == [b"f", b"e"]
    assert board.execute_command("ZRANGE", "z", "-2", "-1", "REV") == [b"b", b"a"]
    with pytest.raises(redis.ResponseError, match="value is not an integer or out of range"):
        board.execute_command("ZRANGE", "z", "a", "1")
    with pytest.raises(redis.ResponseError, match="value is not an integer or out of range"):
        board.execute_command("ZRANGE", "z", "0", "1.5")


def test_zrevrange(board):
    assert board.zrevrange("z", 0, -1) == [b"f", b"e", b"d", b"c", b"b", b"a"]
    assert board.zrevrange("z", 0, 0) == [b"f"]
    assert board.zrevrange("z", -2, -1) == [b"b", b"a"]
    assert pairs(board.zrevrange("z", 1, 2, withscores=True)) == [(b"e", 3.5), (b"d", 2.0)]
    assert board.zrevrange("z", 10, 20) == []
    with pytest.raises(redis.ResponseError, match="syntax error"):
        board.execute_command("ZREVRANGE", "z", "0", "1", "BYSCORE")


def test_zrange_byscore(board):
    assert board.execute_command("ZRANGE", "z", "1", "2", "BYSCORE") == [b"a", b"b", b"c", b"d"]
    assert board.execute_command("ZRANGE", "z", "(1", "2", "BYSCORE") == [b"d"]
    assert board.execute_command("ZRANGE", "z", "(1", "(10", "BYSCORE") == [b"d", b"e"]
    assert board.execute_command("ZRANGE", "z", "-inf", "+inf", "BYSCORE") == board.zrange("z", 0, -1)
    assert board.execute_command("ZRANGE", "z", "-inf", "(1", "BYSCORE") == []
    assert board.execute_command("ZRANGE", "z", "3.5", "3.5", "BYSCORE") == [b"e"]
    assert board.execute_command("ZRANGE", "z", "4", "1", "BYSCORE") == []
    # REV takes max first.
    assert board.execute_command("ZRANGE", "z", "+inf", "(2", "BYSCORE", "REV") == [b"f", b"e"]
    assert board.execute_command("ZRANGE", "z", "1", "+inf", "BYSCORE", "REV") == []
    # LIMIT offset count.
    assert board.execute_command("ZRANGE", "z", "-inf", "+inf", "BYSCORE", "LIMIT", "1", "2") == [b"b", b"c"]
    assert board.execute_command("ZRANGE", "z", "-inf", "+inf", "BYSCORE", "LIMIT", "4", "-1") == [b"e", b"f"]
    assert board.execute_command("ZRANGE", "z", "-inf", "+inf", "BYSCORE", "LIMIT", "4", "10") == [b"e", b"f"]
    assert board.execute_command("ZRANGE", "z", "-inf", "+inf", "BYSCORE", "LIMIT", "6", "10") == []
    assert board.execute_command("ZRANGE", "z", "-inf", "+inf", "BYSCORE", "LIMIT", "0", "0") == []
    assert board.execute_command("ZRANGE", "z", "+inf", "-inf", "BYSCORE", "REV", "LIMIT", "0", "2") == [b"f", b"e"]
    assert pairs(board.zrange("z", 2, 10, byscore=True, withscores=True, offset=1, num=2)) == [
        (b"e", 3.5), (b"f", 10.0)]
    # A negative offset skips everything (Redis's loop never stops skipping).
    assert board.execute_command("ZRANGE", "z", "-inf", "+inf", "BYSCORE", "LIMIT", "-1", "2") == []
    with pytest.raises(redis.ResponseError, match="min or max is not a float"):
        board.execute_command("ZRANGE", "z", "x", "1", "BYSCORE")


def test_zrange_option_errors(board):
    with pytest.raises(redis.ResponseError,
                       match="LIMIT is only supported in combination with either BYSCORE or BYLEX"):
        board.execute_command("ZRANGE", "z", "0", "1", "LIMIT", "0", "1")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        board.execute_command("ZRANGE", "z", "0", "1", "BOGUS")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        board.execute_command("ZRANGE", "z", "0", "1", "BYSCORE", "LIMIT", "0")
    with pytest.raises(redis.ResponseError, match="value is not an integer or out of range"):
        board.execute_command("ZRANGE", "z", "0", "1", "BYSCORE", "LIMIT", "x", "1")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'zrange' command"):
        board.execute_command("ZRANGE", "z", "0")


def test_zrangebyscore_and_zrevrangebyscore(board):
    assert board.zrangebyscore("z", "-inf", "+inf") == board.zrange("z", 0, -1)
    assert board.zrangebyscore("z", "(1", 3.5) == [b"d", b"e"]
    assert board.zrangebyscore("z", 1, "(2") == [b"a", b"b", b"c"]
    assert pairs(board.zrangebyscore("z", 2, "+inf", withscores=True)) == [
        (b"d", 2.0), (b"e", 3.5), (b"f", 10.0)]
    assert board.zrangebyscore("z", "-inf", "+inf", start=2, num=3) == [b"c", b"d", b"e"]
    assert board.zrangebyscore("z", 100, 200) == []
    assert board.zrevrangebyscore("z", "+inf", "-inf") == [b"f", b"e", b"d", b"c", b"b", b"a"]
    assert board.zrevrangebyscore("z", "(10", "(1") == [b"e", b"d"]
    assert board.zrevrangebyscore("z", 2, 1, start=1, num=2) == [b"c", b"b"]
    assert pairs(board.zrevrangebyscore("z", 10, 3.5, withscores=True)) == [(b"f", 10.0), (b"e", 3.5)]
    assert board.zrevrangebyscore("z", 1, 2) == [], "ZREVRANGEBYSCORE takes max first"
    assert board.zrangebyscore("missing", "-inf", "+inf") == []
    with pytest.raises(redis.ResponseError, match="min or max is not a float"):
        board.zrangebyscore("z", "a", "b")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        board.execute_command("ZRANGEBYSCORE", "z", "0", "1", "REV")


def test_zrank_and_zrevrank(board):
    assert board.zrank("z", "a") == 0
    assert board.zrank("z", "c") == 2
    assert board.zrank("z", "f") == 5
    assert board.zrevrank("z", "f") == 0
    assert board.zrevrank("z", "a") == 5
    assert board.zrank("z", "nope") is None
    assert board.zrevrank("z", "nope") is None
    assert board.zrank("missing", "a") is None
    assert board.zrank("z", "e", withscore=True) == [4, 3.5]
    assert board.zrevrank("z", "e", withscore=True) == [1, 3.5]
    assert board.zrank("z", "nope", withscore=True) is None
    assert board.zrevrank("missing", "a", withscore=True) is None
    with pytest.raises(redis.ResponseError, match="syntax error"):
        board.execute_command("ZRANK", "z", "a", "WITHSCORES")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments for 'zrank' command"):
        board.execute_command("ZRANK", "z", "a", "WITHSCORE", "x")


# -- scores: negative, fractional, infinite, NaN -----------------------------------------------


def test_negative_fractional_and_infinite_scores(rc):
    scores = {"ninf": -INF, "neg": -1e9, "frac": -0.25, "zero": 0, "tiny": 1e-300, "pi": 3.14159,
              "huge": 1.7e308, "inf": INF}
    assert rc.zadd("z", scores) == len(scores)
    assert rc.zrange("z", 0, -1) == [m.encode() for m in scores]
    assert pairs(rc.zrange("z", 0, -1, withscores=True)) == [(m.encode(), float(s)) for m, s in scores.items()]
    assert rc.zrangebyscore("z", "-inf", "-inf") == [b"ninf"]
    assert rc.zrangebyscore("z", "+inf", "+inf") == [b"inf"]
    assert rc.zrangebyscore("z", "(-inf", "(+inf") == [m.encode() for m in list(scores)[1:-1]]
    assert rc.zrangebyscore("z", "-1", "1") == [b"frac", b"zero", b"tiny"]
    assert rc.zrangebyscore("z", "(0", "1") == [b"tiny"]
    assert rc.zcount("z", "-inf", "(0") == 3
    assert rc.zscore("z", "tiny") == 1e-300
    assert rc.zscore("z", "huge") == 1.7e308
    assert rc.zrank("z", "inf") == 7
    # -0 and 0 are one score.
    rc.zadd("z", {"negzero": -0.0})
    assert rc.zrangebyscore("z", 0, 0) == [b"negzero", b"zero"]
    assert rc.zscore("z", "negzero") == 0.0
    # An increment may reach infinity (it is not NaN).
    assert rc.zincrby("z", 1.7e308, "huge") == INF
    assert rc.zincrby("z", 5, "inf") == INF


def test_nan_scores_are_refused(rc):
    rc.zadd("z", {"pos": INF, "neg": -INF, "a": 1})
    with pytest.raises(redis.ResponseError, match="resulting score is not a number"):
        rc.zincrby("z", "-inf", "pos")
    with pytest.raises(redis.ResponseError, match="resulting score is not a number"):
        rc.zincrby("z", "+inf", "neg")
    with pytest.raises(redis.ResponseError, match="resulting score is not a number"):
        rc.zadd("z", {"pos": -INF}, incr=True)
    for nan in ["nan", "NaN", "-nan", "(nan"]:
        with pytest.raises(redis.ResponseError, match="not a valid float|not a float"):
            rc.execute_command("ZADD", "z", nan, "a")
        with pytest.raises(redis.ResponseError, match="not a valid float|not a float"):
            rc.execute_command("ZINCRBY", "z", nan, "a")
    with pytest.raises(redis.ResponseError, match="min or max is not a float"):
        rc.execute_command("ZRANGEBYSCORE", "z", "nan", "1")
    with pytest.raises(redis.ResponseError, match="min or max is not a float"):
        rc.execute_command("ZCOUNT", "z", "(nan", "1")
    assert pairs(rc.zrange("z", 0, -1, withscores=True)) == [(b"neg", -INF), (b"a", 1.0), (b"pos", INF)]


# -- limits ------------------------------------------------------------------------------------


def test_zadd_rescoring_every_member_at_once_is_one_atomic_batch(r):
    """Each moved member rewrites its member item and moves its by-score item (3 writes): one
    ZADD rescoring 12,000 members is a batch of 36,000 writes (before chains a batch held 10,000
    and this was refused)."""
    for chunk in range(0, ZSET_MEMBERS, 4000):
        r.zadd("z", {f"m{i}": i for i in range(chunk, min(chunk + 4000, ZSET_MEMBERS))})
    everything = {f"m{i}": i + 0.5 for i in range(ZSET_MEMBERS)}
    assert r.zadd("z", everything, ch=True) == ZSET_MEMBERS
    assert r.zscore("z", "m7") == 7.5
    assert r.zcard("z") == ZSET_MEMBERS
    assert r.zrange("z", 0, 1) == [b"m0", b"m1"]
    assert r.zcount("z", "(11999", "+inf") == 1


def test_set_over_a_zset_replaces_it_in_one_batch(r):
    """SET replaces a key of any type (Redis), in the batch that deletes the set's items,
    whatever the value's size: the largest value shares that batch too (a chain of records)."""
    r.zadd("z", {"a": 1, "b": 2})
    assert r.set("z", b"s" * (16 * 1024 * 1024)) is True
    assert r.type("z") == b"string" and r.strlen("z") == 16 * 1024 * 1024
    r.delete("z")


def test_key_and_member_length_limit(rc):
    key = b"z" * 10
    longest = b"m" * (KEY_AND_MEMBER_BYTES_MAX - len(key))
    assert rc.zadd(key, {longest: 1}) == 1
    assert rc.zscore(key, longest) == 1.0
    assert rc.zrange(key, 0, -1) == [longest]
    too_long = longest + b"m"
    with pytest.raises(redis.ResponseError, match="too long") as info:
        rc.zadd(key, {too_long: 2})
    assert str(KEY_AND_MEMBER_BYTES_MAX) in str(info.value), "the error names the limit"
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.zadd(key, {"ok": 1, too_long: 2})
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.zincrby(key, 1, too_long)
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.zadd("fresh", {b"m" * (KEY_AND_MEMBER_BYTES_MAX - 4): 1})
    assert rc.zrange(key, 0, -1) == [longest]
    assert rc.exists("fresh") == 0
    # Reads of a member that cannot exist find nothing.
    assert rc.zscore(key, too_long) is None
    assert rc.zrank(key, too_long) is None
    assert rc.zmscore(key, [too_long, longest]) == [None, 1.0]
    assert rc.zrem(key, too_long) == 0
    # A key longer than 1013 bytes is stored under a 36-byte name (docs/format/redis-keyspace.md,
    # "Stored names"): it gets the budget of a 36-byte key, and one past the 1 MiB key limit is
    # refused whatever the member.
    long_key = b"K" * 1015
    assert rc.zadd(long_key, {b"m" * (KEY_AND_MEMBER_BYTES_MAX - 36): 1}) == 1
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.zadd(long_key, {b"m" * (KEY_AND_MEMBER_BYTES_MAX - 35): 1})
    with pytest.raises(redis.ResponseError, match="too long"):
        rc.zadd(b"K" * ((1 << 20) + 1), {"m": 1})
    assert rc.dbsize() == 2


# -- types -------------------------------------------------------------------------------------


ZSET_COMMANDS = [
    ("ZADD", "k", "1", "m"),
    ("ZINCRBY", "k", "1", "m"),
    ("ZREM", "k", "m"),
    ("ZSCORE", "k", "m"),
    ("ZMSCORE", "k", "m", "n"),
    ("ZCARD", "k"),
    ("ZCOUNT", "k", "-inf", "+inf"),
    ("ZRANGE", "k", "0", "-1"),
    ("ZRANGE", "k", "0", "1", "BYSCORE", "WITHSCORES"),
    ("ZREVRANGE", "k", "0", "-1"),
    ("ZRANGEBYSCORE", "k", "-inf", "+inf"),
    ("ZREVRANGEBYSCORE", "k", "+inf", "-inf"),
    ("ZRANK", "k", "m"),
    ("ZREVRANK", "k", "m", "WITHSCORE"),
]


@pytest.mark.parametrize("command", ZSET_COMMANDS, ids=[" ".join(c[0:1] + c[4:]) for c in ZSET_COMMANDS])
def test_zset_commands_on_a_string_or_hash_answer_wrongtype(r, command):
    r.set("k", "string")
    with pytest.raises(redis.ResponseError) as info:
        r.execute_command(*command)
    assert str(info.value) == WRONGTYPE
    assert r.get("k") == b"string", f"{command[0]} must not change a string"
    r.delete("k")
    r.hset("k", "f", "v")
    with pytest.raises(redis.ResponseError) as info:
        r.execute_command(*command)
    assert str(info.value) == WRONGTYPE
    assert r.hgetall("k") == {b"f": b"v"}


def test_other_commands_on_a_zset_answer_wrongtype(rc):
    rc.zadd("z", {"m": 1})
    for command in [("GET", "z"), ("INCR", "z"), ("APPEND", "z", "x"), ("HSET", "z", "f", "v"),
                    ("HGETALL", "z"), ("HLEN", "z")]:
        with pytest.raises(redis.ResponseError) as info:
            rc.execute_command(*command)
        assert str(info.value) == WRONGTYPE, command
    assert rc.zscore("z", "m") == 1.0


def test_set_over_a_zset_replaces_it(rc):
    rc.zadd("z", {f"m{i}": i for i in range(100)})
    assert rc.set("z", "now a string") is True
    assert rc.type("z") == b"string"
    assert rc.get("z") == b"now a string"
    assert rc.dbsize() == 1
    rc.delete("z")
    assert rc.zadd("z", {"fresh": 5}) == 1
    assert rc.zcard("z") == 1
    assert pairs(rc.zrange("z", 0, -1, withscores=True)) == [(b"fresh", 5.0)]
    assert rc.zscore("z", "m0") is None
    assert rc.zcount("z", "-inf", "+inf") == 1


def test_del_of_a_large_zset(r):
    for chunk in range(0, ZSET_MEMBERS, 4000):
        r.zadd("z", {f"m{i}": i % 7 for i in range(chunk, min(chunk + 4000, ZSET_MEMBERS))})
    assert r.zcard("z") == ZSET_MEMBERS
    assert r.delete("z") == 1
    assert r.exists("z") == 0
    assert r.zcard("z") == 0
    assert r.zrange("z", 0, -1) == []
    assert r.zrangebyscore("z", "-inf", "+inf") == []
    assert r.zadd("z", {"m1": 1}) == 1
    assert r.zrange("z", 0, -1) == [b"m1"]


def test_sets_that_share_a_prefix_stay_apart(rc):
    rc.zadd("board", {"x": 1, "y": 2})
    rc.zadd("board:1", {"x": 10})
    rc.zadd("boar", {"d:1": 0})
    assert pairs(rc.zrange("board", 0, -1, withscores=True)) == [(b"x", 1.0), (b"y", 2.0)]
    assert pairs(rc.zrange("board:1", 0, -1, withscores=True)) == [(b"x", 10.0)]
    assert rc.zcard("boar") == 1
    assert rc.zcount("board", "-inf", "+inf") == 2


# -- a randomized model ------------------------------------------------------------------------


MEMBERS = [f"m{i:02d}".encode() for i in range(46)] + [b"", b"\x00", b"\xff\xfe", b"m1 \r\n"]


def random_score(rng: random.Random) -> float:
    roll = rng.random()
    if roll < 0.03:
        return rng.choice([INF, -INF])
    if roll < 0.7:
        return float(rng.randint(-5, 5))  # many ties
    return round(rng.uniform(-100, 100), rng.randint(0, 6))


def model_zadd(model: dict, options: set, score_pairs: list):
    """Redis's ZADD on `model` (changed in place); returns the reply, or "nan" for the error."""
    scores = dict(model)
    added = updated = processed = 0
    last = None
    for score, member in score_pairs:
        if member in scores:
            if "NX" in options:
                continue
            current = scores[member]
            new = current + score if "INCR" in options else score
            if math.isnan(new):
                return "nan"
            if ("LT" in options and new >= current) or ("GT" in options and new <= current):
                continue
            processed += 1
            last = new
            if new != current:
                updated += 1
                scores[member] = new
        else:
            if "XX" in options:
                continue
            processed += 1
            added += 1
            last = score
            scores[member] = score
    model.clear()
    model.update(scores)
    if "INCR" in options:
        return last if processed else None
    return added + (updated if "CH" in options else 0)


def random_zadd_options(rng: random.Random) -> set:
    options = set()
    exclusive = rng.choice([None, None, "NX", "XX"])
    if exclusive:
        options.add(exclusive)
    if exclusive != "NX" and rng.random() < 0.3:
        options.add(rng.choice(["GT", "LT"]))
    if rng.random() < 0.3:
        options.add("CH")
    if rng.random() < 0.2:
        options.add("INCR")
    return options


def test_random_operations_match_a_model(r):
    rng = random.Random(20240611)
    model: dict[bytes, float] = {}
    for step in range(300):
        roll = rng.random()
        if roll < 0.55:
            options = random_zadd_options(rng)
            count = 1 if "INCR" in options else rng.randint(1, 6)
            score_pairs = [(random_score(rng), rng.choice(MEMBERS)) for _ in range(count)]
            expected = model_zadd(model, options, score_pairs)
            args = [x for score, member in score_pairs for x in (repr(score), member)]
            command = ("ZADD", "z", *sorted(options), *args)
        elif roll < 0.75:
            by, member = random_score(rng), rng.choice(MEMBERS)
            expected = model_zadd(model, {"INCR"}, [(by, member)])
            command = ("ZINCRBY", "z", repr(by), member)
        else:
            members = [rng.choice(MEMBERS) for _ in range(rng.randint(1, 4))]
            expected = len({m for m in members if m in model})
            for member in members:
                model.pop(member, None)
            command = ("ZREM", "z", *members)
        if expected == "nan":
            with pytest.raises(redis.ResponseError, match="resulting score is not a number"):
                r.execute_command(*command)
        else:
            got = raw_command(r, *command)
            if isinstance(expected, float):
                got = float(got)
            assert got == expected, f"step {step}: {command!r} answered {got!r}, model {expected!r}"
        # The whole set, its size, and a few ranks and scores.
        want = ordered(model)
        probes = rng.sample(MEMBERS, 3)
        pipe = r.pipeline(transaction=False)
        pipe.zrange("z", 0, -1, withscores=True)
        pipe.zcard("z")
        pipe.exists("z")
        for member in probes:
            pipe.zrank("z", member)
            pipe.zrevrank("z", member)
            pipe.zscore("z", member)
        got = pipe.execute()
        assert pairs(got[0]) == want, f"step {step} after {command!r}"
        assert got[1] == len(model), f"step {step}: ZCARD"
        assert got[2] == (1 if model else 0), f"step {step}: EXISTS"
        ranks = {member: at for at, (member, _) in enumerate(want)}
        for i, member in enumerate(probes):
            rank, revrank, score = got[3 + 3 * i : 6 + 3 * i]
            if member in model:
                assert (rank, revrank, score) == (ranks[member], len(model) - 1 - ranks[member],
                                                  model[member]), f"step {step}: {member!r}"
            else:
                assert (rank, revrank, score) == (None, None, None), f"step {step}: {member!r}"
    # And the score ranges agree with the model at the end.
    for low, high in [(-5, 5), (0, 0), (-INF, 0), (1.5, 100)]:
        want = [m for m, s in ordered(model) if low <= s <= high]
        assert r.zrangebyscore("z", low, high) == want
        assert r.zcount("z", low, high) == len(want)


# -- concurrency -------------------------------------------------------------------------------


def test_concurrent_zincrby_is_atomic(server, r):
    def work(client, n):
        for _ in range(60):
            client.zincrby("z", 1, "shared")
            client.zincrby("z", 0.5, f"own:{n}")

    run_clients(server, 8, work)
    assert r.zscore("z", "shared") == 480.0
    assert r.zcard("z") == 9
    assert r.zrange("z", -1, -1) == [b"shared"]
    assert r.zcount("z", 30, 30) == 8


# -- durability --------------------------------------------------------------------------------


def write_zsets(client: redis.Redis) -> dict:
    """A mix of sorted set writes; returns what the store must hold afterwards."""
    expected = {}
    big = {f"member:{i}".encode(): float(i % 100) for i in range(3000)}
    client.zadd("big", big)
    # Moves: the by-score items must follow the member items.
    for i in range(0, 3000, 7):
        member = f"member:{i}".encode()
        big[member] = -big[member] - 0.5
        client.zadd("big", {member: big[member]})
    client.zrem("big", "member:1", "member:2")
    del big[b"member:1"], big[b"member:2"]
    client.zincrby("big", 1000, "member:3")
    big[b"member:3"] += 1000
    expected["big"] = big
    client.zadd("edges", {"ninf": -INF, "inf": INF, "zero": 0, b"\x00\xff": 1.25})
    expected["edges"] = {b"ninf": -INF, b"inf": INF, b"zero": 0.0, b"\x00\xff": 1.25}
    # Gone: emptied by ZREM, deleted whole, replaced by a string.
    client.zadd("emptied", {"a": 1, "b": 2})
    client.zrem("emptied", "a", "b")
    client.zadd("deleted", {f"m{i}": i for i in range(2000)})
    client.delete("deleted")
    client.zadd("replaced", {"a": 1})
    client.set("replaced", "string")
    return expected


def check_zsets(client: redis.Redis, expected: dict):
    for key, model in expected.items():
        want = ordered(model)
        assert pairs(client.zrange(key, 0, -1, withscores=True)) == want, key
        assert client.zcard(key) == len(model), key
        assert client.zcount(key, "-inf", "+inf") == len(model), key
        members = list(model)
        assert client.zmscore(key, members) == [model[m] for m in members], key
        for member in members[:: max(1, len(members) // 50)]:
            assert client.zrank(key, member) == want.index((member, model[member])), (key, member)
    assert client.exists("emptied", "deleted") == 0
    assert client.zrange("deleted", 0, -1) == []
    assert client.get("replaced") == b"string"
    assert client.dbsize() == len(expected) + 1


def test_zsets_survive_a_restart(make_server):
    server = make_server()
    client = server.client()
    expected = write_zsets(client)
    client.close()
    server.stop()
    server.restart()
    client = server.client(protocol=3)
    check_zsets(client, expected)
    assert client.zincrby("big", 1, "member:3") == expected["big"][b"member:3"] + 1
    assert client.zadd("deleted", {"again": 1}) == 1
    assert client.zcard("deleted") == 1
    client.close()


def test_acknowledged_zset_writes_survive_sigkill(make_server):
    server = make_server()
    client = server.client()
    expected = write_zsets(client)
    client.close()
    server.kill()
    assert_store_checks(server)
    server.restart()
    client = server.client()
    check_zsets(client, expected)
    client.close()


def test_zset_writes_under_load_stay_consistent_across_sigkill(make_server):
    """A writer pipelines ZADDs that move the scores of 10 members at a time (each move deletes
    a by-score item and writes two) and ZINCRBYs; the kill lands mid-load. After the restart
    every member has one position and one score (member and by-score items agree), every
    acknowledged score is there or was overwritten by the pipeline in flight, and the counter is
    within what was acknowledged and what was in flight."""
    server = make_server()
    client = server.client(socket_timeout=20)
    members = [f"m{i}".encode() for i in range(200)]
    client.zadd("z", {m: 0 for m in members})
    acked = {m: 0.0 for m in members}
    maybe: dict[bytes, set] = {}
    counts = {"acked": 0, "in_flight": 0, "pipelines": 0}
    errors: list = []
    rng = random.Random(5)

    def load():
        sequence = 0
        while True:
            sequence += 1
            pipe = client.pipeline(transaction=False)
            writes = []
            for _ in range(10):
                chosen = rng.sample(members, 10)
                scores = {m: float(rng.randint(-1000, 1000)) + sequence / 1000 for m in chosen}
                writes.append(scores)
                pipe.zadd("z", scores)
                pipe.zincrby("counter", 1, "n")
            for scores in writes:
                for m, s in scores.items():
                    maybe.setdefault(m, set()).add(s)
            counts["in_flight"] = 10
            try:
                replies = pipe.execute()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                return
            except Exception as err:  # an error reply: reported by the test
                errors.append(err)
                return
            if any(reply != 0 for reply in replies[::2]):
                errors.append(AssertionError(f"ZADD replies {replies[::2]}"))
                return
            for scores in writes:
                acked.update(scores)
            maybe.clear()
            counts["acked"] += 10
            counts["in_flight"] = 0
            counts["pipelines"] += 1

    writer = threading.Thread(target=load)
    writer.start()
    writer.join(timeout=0.8)
    server.kill()
    writer.join(timeout=30)
    assert not writer.is_alive()
    client.close()
    assert not errors, errors
    assert counts["pipelines"] > 0, "no pipeline was acknowledged before the kill"
    server.restart()
    checker = server.client()
    got = pairs(checker.zrange("z", 0, -1, withscores=True))
    assert len(got) == len(members), f"{len(got)} positions for {len(members)} members"
    assert sorted(m for m, _ in got) == sorted(members), "a member lost or doubled"
    assert got == sorted(got, key=lambda item: (item[1], item[0]))
    assert checker.zcard("z") == len(members)
    scores = dict(got)
    assert checker.zmscore("z", members) == [scores[m] for m in members], \
        "member items and by-score items disagree"
    wrong = [(m, scores[m], acked[m]) for m in members
             if scores[m] != acked[m] and scores[m] not in maybe.get(m, set())]
    assert not wrong, f"acknowledged scores lost: {wrong[:5]}"
    counter = int(checker.zscore("counter", "n") or 0)
    assert counts["acked"] <= counter <= counts["acked"] + counts["in_flight"]
    checker.close()
