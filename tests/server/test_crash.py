"""Crash safety over the network: every write the server acknowledged survives SIGKILL.

A writer thread sends pipelines of SETs (and INCRs) and records what each acknowledged pipeline
wrote once its execute() returns. The server is killed mid-load, restarted on the same store,
and every key must hold its latest acknowledged value, or a value of the pipeline that was in
flight at the kill (it may or may not have been applied, wholly or in part).
"""

from __future__ import annotations

import random
import threading
import time

import redis

from support import assert_store_checks

KEYS = 2000
PIPELINE_SETS = 100
PIPELINE_INCRS = 10
CYCLES = 3


class Model:
    """What the server acknowledged, and what may or may not have been applied."""

    def __init__(self):
        self.acked: dict[bytes, bytes] = {}
        # Values of writes in flight at a kill, per key: each is a legal outcome.
        self.maybe: dict[bytes, set[bytes]] = {}
        self.incr_acked = 0
        self.incr_in_flight = 0
        self.pipelines_acked = 0

    def allowed(self, key: bytes) -> set:
        allowed = {self.acked.get(key)}
        allowed |= self.maybe.get(key, set())
        return allowed


def write_load(client: redis.Redis, model: Model, cycle: int, stop: threading.Event, errors: list):
    """Pipelines until the connection breaks (the kill) or `stop` is set."""
    rng = random.Random(cycle)
    sequence = 0
    while not stop.is_set():
        sequence += 1
        writes = []
        pipe = client.pipeline(transaction=False)
        for _ in range(PIPELINE_SETS):
            i = rng.randrange(KEYS)
            key = f"k{i}".encode()
            value = f"{i}:{cycle}:{sequence}".encode() + b"x" * rng.randrange(0, 600)
            writes.append((key, value))
            pipe.set(key, value)
        for _ in range(PIPELINE_INCRS):
            pipe.incr("counter")
        # In flight from here on: a kill leaves any of these applied or not.
        for key, value in writes:
            model.maybe.setdefault(key, set()).add(value)
        model.incr_in_flight = PIPELINE_INCRS
        try:
            replies = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError):
            return  # the server is gone; this pipeline stays "maybe"
        except Exception as err:  # an error reply: a server bug, reported by the test
            errors.append(err)
            return
        if replies[:PIPELINE_SETS] != [True] * PIPELINE_SETS:
            errors.append(AssertionError(f"SET replies {replies[:PIPELINE_SETS]!r}"))
            return
        # Acknowledged: the latest value of each key, in pipeline order.
        for key, value in writes:
            model.acked[key] = value
        model.maybe.clear()  # pipelines go one at a time: nothing else is in flight
        model.incr_acked += PIPELINE_INCRS
        model.incr_in_flight = 0
        model.pipelines_acked += 1


def check_store(client: redis.Redis, model: Model, cycle: int):
    keys = [f"k{i}".encode() for i in range(KEYS)]
    values = []
    for start in range(0, KEYS, 500):
        values.extend(client.mget(keys[start : start + 500]))
    wrong = []
    for key, value in zip(keys, values):
        allowed = model.allowed(key)
        if value not in allowed:
            wrong.append((key, value[:30] if value else value, sorted(v[:30] for v in allowed if v)))
    assert not wrong, (
        f"cycle {cycle}: {len(wrong)} keys lost an acknowledged write; first: {wrong[:3]}"
    )
    counter = int(client.get("counter") or 0)
    assert model.incr_acked <= counter <= model.incr_acked + model.incr_in_flight, (
        f"cycle {cycle}: counter {counter}, acknowledged {model.incr_acked}, "
        f"in flight {model.incr_in_flight}"
    )
    # What survived is now the truth: the in-flight writes were applied or not, once and for all.
    for key, value in zip(keys, values):
        if value is None:
            model.acked.pop(key, None)
        else:
            model.acked[key] = value
    model.maybe.clear()
    model.incr_acked = counter
    model.incr_in_flight = 0


def test_acknowledged_writes_survive_sigkill(make_server):
    server = make_server()
    model = Model()
    rng = random.Random(7)
    for cycle in range(1, CYCLES + 1):
        client = server.client(socket_timeout=20)
        stop = threading.Event()
        errors: list = []
        writer = threading.Thread(target=write_load, args=(client, model, cycle, stop, errors))
        acked_before = model.pipelines_acked
        writer.start()
        time.sleep(rng.uniform(1.0, 2.0))
        server.kill()
        writer.join(timeout=30)
        assert not writer.is_alive(), "the writer did not notice the kill"
        client.close()
        assert not errors, errors
        assert model.pipelines_acked > acked_before, f"cycle {cycle}: no pipeline was acknowledged"
        # The offline check finds nothing wrong with a store whose server was killed.
        assert_store_checks(server)
        server.restart()
        checker = server.client()
        check_store(checker, model, cycle)
        # The store takes writes again after recovery.
        assert checker.set("after:crash", cycle) is True
        assert checker.get("after:crash") == str(cycle).encode()
        checker.close()
    # The make_server fixture then stops the server with SIGTERM and expects exit status 0.


def test_sigterm_under_load_keeps_every_acknowledged_write(make_server):
    """SIGTERM mid-load: the server answers what it has read, exits 0, and the acknowledged
    writes are all there after a restart."""
    server = make_server()
    model = Model()
    client = server.client(socket_timeout=20)
    stop = threading.Event()
    errors: list = []
    writer = threading.Thread(target=write_load, args=(client, model, 1, stop, errors))
    writer.start()
    time.sleep(1.0)
    server.stop()  # SIGTERM; fails unless the exit status is 0 within 15 s
    writer.join(timeout=30)
    assert not writer.is_alive(), "the writer did not notice the shutdown"
    client.close()
    assert not errors, errors
    assert model.pipelines_acked > 0
    server.restart()
    checker = server.client()
    check_store(checker, model, 1)
    checker.close()


def test_graceful_restart_keeps_everything(make_server):
    server = make_server()
    client = server.client()
    pipe = client.pipeline(transaction=False)
    for i in range(3000):
        pipe.set(f"g{i}", f"value-{i}")
    pipe.execute()
    client.incrby("n", 41)
    client.append("g0", "+tail")
    client.delete("g1")
    client.close()
    server.stop()
    server.restart()
    client = server.client()
    assert client.dbsize() == 3000  # 2999 g-keys and n
    assert client.get("g0") == b"value-0+tail"
    assert client.get("g1") is None
    assert client.get("g2999") == b"value-2999"
    assert client.incr("n") == 42
    client.close()
