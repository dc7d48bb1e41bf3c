"""What one authenticated client can make the server hold (docs/security.md, docs/server.md
"Limits"): the query buffer, a reply that would pass the output limit, MGET of repeated keys.

Each memory bound is measured as the server's peak resident memory (VmHWM) around the request,
with requests large enough to pass the bound many times over were it not enforced.
"""

from __future__ import annotations

import redis

from support import Error, RespReader, encode_command, recv_all_until_close

MIB = 1024 * 1024


def write_config(tmp_path, text: str) -> str:
    path = tmp_path / "copse.toml"
    path.write_text(text)
    return str(path)


def test_mget_of_one_key_many_times_reads_it_once_and_refuses_a_reply_over_the_limit(make_server):
    """The review's request: MGET of one 1 MiB key 2,000 times (an 18 KB request) peaked at
    4 GiB at 101534c before answering the limit error. The reply would be 2 GiB, over the
    256 MiB output limit: refused having read the key once."""
    server = make_server()
    client = server.client()
    client.set("one", b"m" * MIB)
    peak_before = server.peak_rss_bytes()
    with server.connect(timeout=60) as sock:
        sock.sendall(encode_command("MGET", *(["one"] * 2000)) + b"PING\r\n")
        reader = RespReader(sock)
        error = reader.read()
        assert isinstance(error, Error) and error.startswith(b"ERR reply of at least "), error[:200]
        assert error.endswith(b"exceeds the client output limit (268435456 bytes)"), error
        assert reader.read() == b"PONG", "a refused MGET leaves the connection usable"
    growth = server.peak_rss_bytes() - peak_before
    assert growth < 64 * MIB, f"MGET of one key 2,000 times grew peak RSS by {growth / MIB:.0f} MiB"
    # Under the limit, every position is filled, however often a key is named.
    client.set("two", "2")
    assert client.mget(["one", "two", "missing", "two", "one"]) == [
        b"m" * MIB, b"2", None, b"2", b"m" * MIB
    ]
    assert len(client.mget(["one"] * 200)) == 200
    client.close()


def test_mget_of_distinct_keys_stops_reading_at_the_output_limit(make_server, tmp_path):
    config = write_config(tmp_path, f"client_output_bytes_max = {8 * MIB}\n")
    server = make_server("--config", config)
    client = server.client()
    value = b"d" * MIB
    keys = [f"d{i}" for i in range(200)]
    for start in range(0, len(keys), 10):
        client.mset({key: value for key in keys[start : start + 10]})
    peak_before = server.peak_rss_bytes()
    try:
        client.mget(keys)
        raise AssertionError("an MGET of 200 MiB passed an 8 MiB output limit")
    except redis.ResponseError as err:
        assert "exceeds the client output limit (8388608 bytes)" in str(err), err
    growth = server.peak_rss_bytes() - peak_before
    # The limit plus a step's reads per shard; 200 MiB (twice that at 101534c) without it.
    assert growth < 96 * MIB, f"the refused MGET grew peak RSS by {growth / MIB:.0f} MiB"
    assert client.ping() is True
    assert client.mget(keys[:7]) == [value] * 7
    client.close()


def test_a_request_over_the_query_buffer_limit_closes_the_client(make_server, tmp_path):
    config = write_config(tmp_path, f"client_query_buffer_bytes_max = {2 * MIB}\n")
    server = make_server("--config", config)
    value_bytes = 12 * MIB
    sent = 0
    with server.connect(timeout=30) as sock:
        sock.sendall(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % value_bytes)
        try:
            while sent < value_bytes:
                sock.sendall(b"q" * (256 * 1024))
                sent += 256 * 1024
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            data = recv_all_until_close(sock)
        except ConnectionResetError:
            data = b""
    assert sent < value_bytes, "the server buffered a request larger than its query buffer limit"
    # The error may be lost to a reset when the client is still sending; when it arrives it
    # names the limit.
    assert data in (b"", b"-ERR Protocol error: request exceeds the client query buffer limit (2097152 bytes)\r\n"), data[:200]
    client = server.client()
    assert client.exists("k") == 0
    assert client.info("stats")["copse_query_buffer_closes"] == 1
    # A request that fits is served whole.
    client.set("k", b"f" * MIB)
    assert client.strlen("k") == MIB
    client.close()


def test_hgetall_over_the_output_limit_is_refused_as_it_reads(make_server, tmp_path):
    """At 101534c HGETALL read every value of the hash in one scan and encoded the reply before
    the limit was checked: a 192 MiB hash against a 16 MiB limit. Now it reads in steps within
    the limit and stops with an error."""
    config = write_config(tmp_path, f"client_output_bytes_max = {16 * MIB}\n")
    server = make_server("--config", config)
    client = server.client()
    value = b"v" * (8 * MIB)
    for field in range(24):
        client.hset("h", f"f{field}", value)
    peak_before = server.peak_rss_bytes()
    for command in ("HGETALL", "HVALS"):
        try:
            client.execute_command(command, "h")
            raise AssertionError(f"{command} of 192 MiB passed a 16 MiB output limit")
        except redis.ResponseError as err:
            assert "exceeds the client output limit (16777216 bytes)" in str(err), err
    growth = server.peak_rss_bytes() - peak_before
    assert growth < 64 * MIB, f"a refused HGETALL grew peak RSS by {growth / MIB:.0f} MiB"
    assert client.ping() is True
    client.hset("small", mapping={"a": "1", "b": "2"})
    assert client.hgetall("small") == {b"a": b"1", b"b": b"2"}
    assert sorted(client.hvals("small")) == [b"1", b"2"]
    client.close()


def test_hmget_reads_each_field_once_and_refuses_a_reply_over_the_limit_as_it_reads(make_server, tmp_path):
    """HMGET built its whole reply before the output limit was checked (a field named 2,000
    times, or many large fields): the MGET finding of issue 20 for hashes. Now each field is
    read once, in steps within the limit, and a reply past it is refused with an error."""
    config = write_config(tmp_path, f"client_output_bytes_max = {16 * MIB}\n")
    server = make_server("--config", config)
    client = server.client()
    value = b"w" * MIB
    for field in range(40):
        client.hset("wide", f"f{field}", value)
    peak_before = server.peak_rss_bytes()
    with server.connect(timeout=60) as sock:
        # One field 2,000 times (a 2 GiB reply), then 40 distinct 1 MiB fields (40 MiB).
        sock.sendall(
            encode_command("HMGET", "wide", *(["f0"] * 2000))
            + encode_command("HMGET", "wide", *[f"f{field}" for field in range(40)])
            + b"PING\r\n"
        )
        reader = RespReader(sock)
        for _ in range(2):
            error = reader.read()
            assert isinstance(error, Error), error if not isinstance(error, list) else len(error)
            assert error.endswith(b"exceeds the client output limit (16777216 bytes)"), error
        assert reader.read() == b"PONG", "a refused HMGET leaves the connection usable"
    growth = server.peak_rss_bytes() - peak_before
    assert growth < 64 * MIB, f"refused HMGETs grew peak RSS by {growth / MIB:.0f} MiB"
    # Under the limit every position is filled, however often a field is named.
    client.hset("small", mapping={"a": "1", "b": "2"})
    assert client.hmget("small", ["a", "b", "missing", "b", "a"]) == [b"1", b"2", None, b"2", b"1"]
    assert client.hmget("wide", ["f1", "f1", "nope"]) == [value, value, None]
    assert client.hmget("absent", ["a", "b"]) == [None, None]
    client.close()


def test_keys_over_the_output_limit_is_refused_as_it_lists(make_server, tmp_path):
    """KEYS listed every matching key of the store before the output limit was checked. With a
    1 MiB limit and ~4 MiB of key names it is refused with an error, the connection usable."""
    config = write_config(tmp_path, f"client_output_bytes_max = {1 * MIB}\n")
    server = make_server("--config", config)
    client = server.client()
    pipe = client.pipeline(transaction=False)
    for index in range(4000):
        pipe.set(f"{'k' * 1000}{index}", "v")
    pipe.execute()
    try:
        client.keys("*")
        raise AssertionError("KEYS of about 4 MiB passed a 1 MiB output limit")
    except redis.ResponseError as err:
        assert "exceeds the client output limit (1048576 bytes)" in str(err), err
    assert client.ping() is True
    assert len(client.keys("k*1")) < 1000
    client.close()


def test_hstrlen_is_not_counted_as_the_value_it_measures(make_server, tmp_path):
    """Review finding: HSTRLEN read through the same path as HMGET and counted the value it
    measures against the output limit, answering an error for a field larger than the limit."""
    config = write_config(tmp_path, f"client_output_bytes_max = {1 * MIB}\n")
    server = make_server("--config", config)
    client = server.client()
    client.hset("h", "big", b"b" * (2 * MIB))
    assert client.hstrlen("h", "big") == 2 * MIB
    client.close()


def test_pipelined_mgets_of_small_values_do_not_wait_for_each_other(make_server):
    """Review finding: MGET reserved the whole output limit (256 MiB), more than the pending-reply
    budget (64 MiB), so every MGET of a pipeline waited for every reply before it. It now reserves
    one value per key named, at the largest value the store holds. (One shard: an MGET over
    several shards answers after every earlier reply anyway, by design.)"""
    server = make_server(shards=1)
    client = server.client()
    client.mset({f"s{i}": "v" * 100 for i in range(10)})
    waits_before = int(client.info("stats")["copse_reply_backpressure_waits"])
    pipe = client.pipeline(transaction=False)
    for _ in range(500):
        pipe.mget([f"s{i}" for i in range(10)])
    assert all(len(reply) == 10 for reply in pipe.execute())
    waits = int(client.info("stats")["copse_reply_backpressure_waits"]) - waits_before
    assert waits == 0, f"{waits} pipelined MGETs waited for the replies before them"
    client.close()
