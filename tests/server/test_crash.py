"""Crash safety over the network: every write the server acknowledged survives SIGKILL.

Several writer threads, each on its own connection and its own keys, send pipelines of SETs,
DELs, MSETs and INCRs, and record what each acknowledged pipeline wrote once its execute()
returns. The server is killed at a random moment, restarted on the same store, and every key must
hold its latest acknowledged state, or a state of the pipeline that was in flight at the kill (it
may or may not have been applied, wholly or in part). `COPSE_SERVER_KILL_CYCLES` sets the number
of kill cycles (3 here; `make torture` runs 1,000), `COPSE_SERVER_KILL_SEED` the seed.
"""

from __future__ import annotations

import os
import random
import threading
import time

import redis

from support import assert_store_checks

KEYS = 2000
WRITERS = 3
PIPELINE_WRITES = 100
PIPELINE_INCRS = 10
CYCLES = int(os.environ.get("COPSE_SERVER_KILL_CYCLES", "3"))
SEED = int(os.environ.get("COPSE_SERVER_KILL_SEED", "7"))


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


def writer_keys(writer: int) -> list[bytes]:
    """The keys one writer owns (writers never share a key, so each keeps its own model)."""
    return [f"k{i}".encode() for i in range(writer, KEYS, WRITERS)]


def write_load(
    client: redis.Redis, model: Model, writer: int, cycle: int, stop: threading.Event, errors: list
):
    """Pipelines until the connection breaks (the kill) or `stop` is set. A write's value is
    unique (writer, cycle, sequence); None stands for a delete."""
    rng = random.Random(f"{SEED}:{writer}:{cycle}")
    keys = writer_keys(writer)
    counter = f"counter:{writer}"
    sequence = 0
    while not stop.is_set():
        sequence += 1
        writes: list[tuple[bytes, bytes | None]] = []
        pipe = client.pipeline(transaction=False)
        expected = []
        while len(writes) < PIPELINE_WRITES:
            roll = rng.random()
            if roll < 0.08:
                key = rng.choice(keys)
                writes.append((key, None))
                pipe.delete(key)
                expected.append(None)  # 0 or 1, checked below
            elif roll < 0.2:
                pairs = {}
                for key in rng.sample(keys, rng.randrange(2, 5)):
                    pairs[key] = f"{writer}:{cycle}:{sequence}:m{len(writes)}".encode()
                writes.extend(pairs.items())
                pipe.mset(pairs)
                expected.append(True)
            else:
                key = rng.choice(keys)
                value = f"{writer}:{cycle}:{sequence}:{len(writes)}".encode()
                value += b"x" * rng.randrange(0, 600)
                writes.append((key, value))
                pipe.set(key, value)
                expected.append(True)
        for _ in range(PIPELINE_INCRS):
            pipe.incr(counter)
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
        for want, got in zip(expected, replies[: len(expected)]):
            if (want is True and got is not True) or (want is None and got not in (0, 1)):
                errors.append(AssertionError(f"writer {writer}: reply {got!r}, expected {want!r}"))
                return
        # Acknowledged: the latest state of each key, in pipeline order.
        for key, value in writes:
            if value is None:
                model.acked.pop(key, None)
            else:
                model.acked[key] = value
        model.maybe.clear()  # a writer's pipelines go one at a time: nothing else is in flight
        model.incr_acked += PIPELINE_INCRS
        model.incr_in_flight = 0
        model.pipelines_acked += 1


def check_store(client: redis.Redis, model: Model, writer: int, cycle: int):
    keys = writer_keys(writer)
    values = []
    for start in range(0, len(keys), 500):
        values.extend(client.mget(keys[start : start + 500]))
    wrong = []
    for key, value in zip(keys, values):
        allowed = model.allowed(key)
        if value not in allowed:
            shown = sorted(v[:30] if v else b"(absent)" for v in allowed)
            wrong.append((key, value[:30] if value else value, shown))
    assert not wrong, (
        f"cycle {cycle}, writer {writer}: {len(wrong)} keys lost an acknowledged write; "
        f"first: {wrong[:3]}"
    )
    counter = int(client.get(f"counter:{writer}") or 0)
    assert model.incr_acked <= counter <= model.incr_acked + model.incr_in_flight, (
        f"cycle {cycle}, writer {writer}: counter {counter}, acknowledged {model.incr_acked}, "
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
    models = [Model() for _ in range(WRITERS)]
    rng = random.Random(SEED)
    # Short cycles when many are asked for (make torture), so that a kill may also land early in
    # a run, right after recovery.
    many = CYCLES > 10
    pause = (0.05, 1.0) if many else (1.0, 2.0)
    checked = 0
    for cycle in range(1, CYCLES + 1):
        clients = [server.client(socket_timeout=20) for _ in range(WRITERS)]
        stop = threading.Event()
        errors: list = []
        writers = [
            threading.Thread(
                target=write_load, args=(clients[w], models[w], w, cycle, stop, errors)
            )
            for w in range(WRITERS)
        ]
        acked_before = sum(model.pipelines_acked for model in models)
        for thread in writers:
            thread.start()
        time.sleep(rng.uniform(*pause))
        server.kill()
        for thread in writers:
            thread.join(timeout=30)
            assert not thread.is_alive(), "a writer did not notice the kill"
        for client in clients:
            client.close()
        assert not errors, errors
        if not many:
            acked = sum(model.pipelines_acked for model in models)
            assert acked > acked_before, f"cycle {cycle}: no pipeline was acknowledged"
            # The offline check finds nothing wrong with a store whose server was killed.
            assert_store_checks(server)
        server.restart()
        checker = server.client()
        for writer, model in enumerate(models):
            check_store(checker, model, writer, cycle)
            checked += len(model.acked)
        # The store takes writes again after recovery.
        assert checker.set("after:crash", cycle) is True
        assert checker.get("after:crash") == str(cycle).encode()
        checker.close()
    acked = sum(model.pipelines_acked for model in models)
    print(
        f"server kill loop: {CYCLES} cycles, seed {SEED}, {acked} pipelines acknowledged, "
        f"{checked} key states checked"
    )
    # The make_server fixture then stops the server with SIGTERM and expects exit status 0.


def test_sigterm_under_load_keeps_every_acknowledged_write(make_server):
    """SIGTERM mid-load: the server answers what it has read, exits 0, and the acknowledged
    writes are all there after a restart."""
    server = make_server()
    model = Model()
    client = server.client(socket_timeout=20)
    stop = threading.Event()
    errors: list = []
    writer = threading.Thread(target=write_load, args=(client, model, 0, 1, stop, errors))
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
    check_store(checker, model, 0, 1)
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
