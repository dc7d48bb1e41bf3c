"""Pub/Sub (issue 24 item 4): SUBSCRIBE, PSUBSCRIBE, SSUBSCRIBE, their UNSUBSCRIBEs, PUBLISH,
SPUBLISH and PUBSUB, compared with redis-server frame by frame (RESP2 and RESP3), delivered to
subscribers on any network thread in order, after the writes of a transaction or a script, and
with a slow subscriber disconnected at its output limit instead of growing the server's memory.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import redis

from support import RespReader, encode_command


class Pair:
    """One raw connection to copse and one to redis-server, frames compared one by one."""

    def __init__(self, server, oracle, protocol: int = 2):
        self.sides = []
        for sock in (server.connect(), oracle.connect()):
            reader = RespReader(sock)
            if protocol == 3:
                sock.sendall(encode_command("HELLO", "3"))
                reader.read()
            self.sides.append((sock, reader))

    def send(self, *args):
        for sock, _ in self.sides:
            sock.sendall(encode_command(*args))

    def frames(self, count: int, label: str, unordered: bool = False):
        ours = [self.sides[0][1].read() for _ in range(count)]
        theirs = [self.sides[1][1].read() for _ in range(count)]
        if unordered:
            ours, theirs = [sorted(x) for x in ours], [sorted(x) for x in theirs]
        assert ours == theirs, f"{label}: copse {ours}, redis-server {theirs}"
        return ours

    def both(self, *args, frames: int = 1, unordered: bool = False):
        self.send(*args)
        return self.frames(frames, " ".join(args), unordered)

    def close(self):
        for sock, _ in self.sides:
            sock.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_subscription_frames_and_messages_match_redis(server, oracle, protocol):
    listener = Pair(server, oracle, protocol)
    talker = Pair(server, oracle, protocol)
    listener.both("SUBSCRIBE", f"news{protocol}", f"sport{protocol}", frames=2)
    listener.both("PSUBSCRIBE", f"n*{protocol}", frames=1)
    listener.both("SSUBSCRIBE", f"shard{protocol}", frames=1)
    talker.both("PUBLISH", f"news{protocol}", "hello")  # one channel and one pattern
    listener.frames(2, "message and pmessage")
    talker.both("PUBLISH", f"sport{protocol}", "goal")
    listener.frames(1, "message")
    talker.both("SPUBLISH", f"shard{protocol}", "sharded")
    listener.frames(1, "smessage")
    talker.both("PUBLISH", "nobody-listens", "x")
    talker.both("PUBSUB", "NUMSUB", f"news{protocol}", f"sport{protocol}", "none")
    talker.both("PUBSUB", "NUMPAT")
    talker.both("PUBSUB", "CHANNELS", f"*{protocol}", unordered=True)
    talker.both("PUBSUB", "SHARDCHANNELS")
    talker.both("PUBSUB", "SHARDNUMSUB", f"shard{protocol}")
    if protocol == 2:
        listener.both("GET", "k")  # refused while subscribed in RESP2
        listener.both("PING")
        listener.both("PING", "hi")
    else:
        listener.both("PING")
    listener.both("UNSUBSCRIBE", f"news{protocol}")
    listener.both("UNSUBSCRIBE", f"sport{protocol}")
    listener.both("UNSUBSCRIBE")
    listener.both("PUNSUBSCRIBE", f"n*{protocol}")
    listener.both("SUNSUBSCRIBE", f"shard{protocol}")
    listener.both("PUNSUBSCRIBE")
    listener.both("PING")
    talker.both("PUBSUB", "NUMSUB", f"news{protocol}")
    talker.both("PUBSUB", "FOO")
    listener.close()
    talker.close()


def test_resp3_messages_are_push_frames(server):
    sock = server.connect()
    reader = RespReader(sock)
    sock.sendall(encode_command("HELLO", "3"))
    reader.read()
    sock.sendall(encode_command("SUBSCRIBE", "pushed"))
    reader.read()
    client = server.client()
    assert client.publish("pushed", "payload") == 1
    sock.settimeout(5)
    data = b""
    while data.count(b"\r\n") < 7:
        data += sock.recv(4096)
    assert data.startswith(b">3\r\n$7\r\nmessage\r\n$6\r\npushed\r\n$7\r\npayload\r\n"), data
    sock.close()
    client.close()


def test_messages_arrive_in_order_on_every_thread(server):
    """Subscribers on several connections (spread over the network threads) each get every
    message, in publication order."""
    count, subscribers = 500, 4
    clients = [server.client() for _ in range(subscribers)]
    subscriptions = []
    for client in clients:
        pubsub = client.pubsub()
        pubsub.subscribe("ordered")
        assert pubsub.get_message(timeout=5)["type"] == "subscribe"
        subscriptions.append(pubsub)
    publisher = server.client()
    for i in range(count):
        assert publisher.publish("ordered", i) == subscribers
    for pubsub in subscriptions:
        got = []
        deadline = time.time() + 30
        while len(got) < count and time.time() < deadline:
            message = pubsub.get_message(timeout=1)
            if message and message["type"] == "message":
                got.append(int(message["data"]))
        assert got == list(range(count))
        pubsub.close()
    assert publisher.pubsub_numsub("ordered") == [(b"ordered", 0)] or time.sleep(0.5) is None
    publisher.close()


def test_a_publish_in_a_transaction_or_a_script_comes_after_its_writes(server):
    """The subscriber reads the key the moment the message arrives: the write it announces is
    there (the message is delivered only once the write is durable and applied)."""
    listener = server.client()
    pubsub = listener.pubsub()
    pubsub.subscribe("announce")
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"
    writer = server.client()
    reader = server.client()
    for i in range(50):
        pipe = writer.pipeline(transaction=True)
        pipe.set(f"announced:{i}", i)
        pipe.publish("announce", f"announced:{i}")
        assert pipe.execute() == [True, 1]
        writer.eval("redis.call('SET', KEYS[1], ARGV[1]); return redis.call('PUBLISH', 'announce', KEYS[1])",
                    1, f"scripted:{i}", i)
    seen = 0
    deadline = time.time() + 30
    while seen < 100 and time.time() < deadline:
        message = pubsub.get_message(timeout=1)
        if message and message["type"] == "message":
            assert reader.get(message["data"]) is not None, message
            seen += 1
    assert seen == 100
    for client in (listener, writer, reader):
        client.close()


def server_rss_kib(server) -> int:
    with open(f"/proc/{server.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_subscriber_that_does_not_read_is_closed_at_its_limit(make_server):
    """A raw subscriber never reads while 200 MiB are published to it: the server closes it
    at its 32 MiB output limit, and its memory does not grow with what was published."""
    server = make_server()
    sock = server.connect()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(encode_command("SUBSCRIBE", "flood"))
    publisher = server.client()
    time.sleep(0.2)
    before = server_rss_kib(server)
    payload = b"x" * (1024 * 1024)
    delivered = 0
    for _ in range(200):
        delivered += publisher.publish("flood", payload)
    grown_mib = (server_rss_kib(server) - before) / 1024
    assert delivered < 200, "every message was queued for a subscriber that never reads"
    assert grown_mib < 96, f"the server grew by {grown_mib:.0f} MiB for one slow subscriber"
    # The server ended the connection (its subscriptions go with it); the bytes already in the
    # kernel's buffers may still trickle to the socket, so the server's side is what is checked.
    deadline = time.time() + 30
    while publisher.pubsub_numsub("flood") != [(b"flood", 0)] and time.time() < deadline:
        time.sleep(0.1)
    assert publisher.pubsub_numsub("flood") == [(b"flood", 0)], "the slow subscriber is still there"
    sock.close()
    assert publisher.publish("flood", "after") == 0
    publisher.close()


def test_no_message_follows_the_unsubscribe_reply_in_resp2(server):
    """Under a publish flood, UNSUBSCRIBE pipelined with a GET: every message frame comes before
    the UNSUBSCRIBE reply, none after it (a RESP2 client would take it for the GET's reply)."""
    import threading

    stop = threading.Event()

    def flood():
        client = server.client()
        while not stop.is_set():
            client.publish("flooded", "m" * 64)
        client.close()

    server.client().set("k", "VALUE")
    thread = threading.Thread(target=flood)
    thread.start()
    try:
        for _ in range(20):
            sock = server.connect()
            reader = RespReader(sock)
            sock.sendall(encode_command("SUBSCRIBE", "flooded"))
            assert reader.read()[0] == b"subscribe"
            time.sleep(0.01)
            sock.sendall(encode_command("UNSUBSCRIBE", "flooded") + encode_command("GET", "k"))
            while True:
                frame = reader.read()
                if isinstance(frame, list) and frame[0] == b"message":
                    continue
                assert frame[0] == b"unsubscribe", frame
                break
            assert reader.read() == b"VALUE"
            sock.close()
    finally:
        stop.set()
        thread.join()
